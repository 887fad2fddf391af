-- release.lua: append a queue's due scheduled messages to its log (lib/schedule.lua).
--@include lib/schedule.lua
--@include lib/lite.lua
--@flags allow-oom
--
-- Returns: {ids, push members, next due} (in full after ARGV)
-- Errors: BADARG (in full after ARGV)
-- KEYS[1] meta
-- KEYS[2] log
-- KEYS[3] scheduled
-- KEYS[4] scheduled_bodies
-- KEYS[5] held            (held, ready, delayed: read to trim what every group has settled)
-- KEYS[6] ready
-- KEYS[7] delayed
-- KEYS[8] journal
-- KEYS[9] wake
-- KEYS[10] dedup          (dedup, dedup_ids, dead: an lmq's keys, revived with it)
-- KEYS[11] dedup_ids
-- KEYS[12] dead
-- KEYS[13] totals         the broker's totals (lib/totals.lua)
-- KEYS[14] backlogs
-- KEYS[15] priority       a priority queue's index of levels (lib/priority.lua)
-- KEYS[16] rest           the slot's rest hash: an lmq at rest keeps its meta there (lib/meta.lua)
-- ARGV[1] upto            release what is due at or before this ms (the sweeper's look at the
--                         schedule, which fanned these messages out first), and not after now
-- ARGV[2] limit           at most this many messages per call
-- ARGV[3] maxlen          messages kept at most, whatever their state (0 = no limit)
-- ARGV[4] maxage_ms       (0 = no limit)
-- ARGV[5] maxbytes        (0 = no limit)
-- ARGV[6] keep            1: the topic has a retention policy (lib/retention.lua); 0: settled messages go
-- ARGV[7] idle_ttl_ms     of an lmq (0 = a plain topic)
-- ARGV[8] journal_cap     (0 = off)
-- ARGV[9] clock_ids       1: an lmq or a filter queue: its ids start at the clock (lib/meta.lua, start_ids)
-- Returns, in full: {ids, push members, next due}: the message ids the released messages got (in due
--   order: each enters the log now, stamped with now), the queue's push members as 'group TAB
--   member' lines (false when none) for the worker to dispatch to, and when the next scheduled
--   message is due (-1: none left).
-- A message cancelled before (unpub.lua) is not released; one released is no longer
-- cancellable. Idempotent: several sweepers may release one queue at once, each message once.
-- Errors, in full: BADARG when a number is not an integer.
-- Cost: O(released · log n + trimmed).
wake_from_rest(K)  -- an lmq at rest gets its meta key back first (lib/meta.lua)
local upto = int_arg(A.upto, 'upto')
local limit = int_arg(A.limit, 'limit', 1)
local maxlen = int_arg(A.maxlen, 'MAXLEN')
local maxage = int_arg(A.maxage_ms, 'MAXAGE')
local maxbytes = int_arg(A.maxbytes, 'MAXBYTES')
local idle_ttl = int_arg(A.idle_ttl_ms, 'idle TTL')
local now = now_ms()
if upto > now then upto = now end
local due = take_due(K, upto, limit)
if #due == 0 then return {{}, false, first_scheduled(K)} end
expand_meta(K.meta)  -- validated: now the writes, with no field left to a default
local seq, fresh = start_ids(K, now, A.clock_ids == '1')
local texts = int_strs(seq + 1, #due)
local pairs_ = {}
for i, d in ipairs(due) do
  pairs_[2 * i - 1] = texts[i]
  pairs_[2 * i] = restamp(d[2], now)
end
redis.call('HSET', K.log, unpack(pairs_))
if prio_on(K) then  -- each at the level it was published with (lib/priority.lua)
  for i, d in ipairs(due) do index_messages(K, scheduled_level(d[1]), seq + i, seq + i) end
end
if fresh then
  redis.call('HSET', K.meta, 'ct', now)
  count_queue(K, 1)
end
redis.call('HSET', K.meta, 'seq', seq + #due, 'wt', now, 'jcap', A.journal_cap)
count_appended(K, #due)
if journal_on(K, A.journal_cap) then
  local ids = {}
  for i = 1, #due do ids[i] = seq + i end
  journal_batch(now, 'pub', nil, nil, ids)
end
trim_log(K, #due + 100, A.keep == '1', maxlen, maxage, maxbytes, now)
if idle_ttl > 0 then revive(K) end
flush_journal(K)
redis.call('SPUBLISH', K.wake, seq + #due)
return {texts, redis.call('HGET', K.meta, 'push'), first_scheduled(K)}
