-- purge.lua: an operator drops every message a queue's subscriptions have not been given yet.
--@include lib/lite.lua
--@flags allow-oom
--
-- Returns: {seq, six entries per group} (in full after ARGV)
-- Errors: NOTFOUND (in full after ARGV)
-- KEYS[1] meta
-- KEYS[2] log
-- KEYS[3] checkouts
-- KEYS[4] owned
-- KEYS[5] ready
-- KEYS[6] delayed
-- KEYS[7] dedup
-- KEYS[8] dedup_ids
-- KEYS[9] journal
-- KEYS[10] dead           (an lmq holding dead letters is not reclaimed: lib/lite.lua)
-- KEYS[11] totals         the broker's totals (lib/totals.lua)
-- KEYS[12] backlogs
-- KEYS[13] priority       a priority queue's index of levels (lib/priority.lua)
-- KEYS[14] rest           the slot's rest hash: an lmq at rest keeps its meta there (lib/meta.lua)
-- ARGV[1] idle_ttl_ms     of an lmq (0 = a plain topic)
-- Returns, in full: {seq, {group, cursor before, unread dropped, returned dropped,
--   delayed dropped, checkouts left, ...}} (six entries per group, in the
--   order the groups were created).
-- Every group of the queue: its cursor moves to seq + 1 (nothing published
-- so far is read by it any more) and its returned (ready) and delayed
-- redeliveries are dropped. Checkouts are left alone: a message held by a
-- consumer — leased, or waiting in a push mailbox — can still be ACKed, and
-- a NACK or an expired lease still returns it to its group (and a NACK may
-- still dead-letter it). Epochs do not change, so no tag goes stale.
-- The log itself is left to retention: a SEEK back (or a new group created
-- FROM EARLIEST) reads those messages again, and dead letters stay
-- replayable. One 'purge' journal event per group (id = the new cursor,
-- extra = messages dropped), or one without a group when there is none.
-- An lmq left with nothing to read and no owner gets its idle TTL.
-- Errors, in full: NOTFOUND when the queue does not exist.
-- Cost: O(groups · log n + returned and delayed messages of the queue).
wake_from_rest(K)  -- an lmq at rest gets its meta key back first (lib/meta.lua)
expand_meta(K.meta)  -- this fence writes meta: no field may be left to a default
local ttl = int_arg(A.idle_ttl_ms, 'idle TTL')
if redis.call('EXISTS', K.meta) == 0 then raise('NOTFOUND', 'no such queue; list them with `fencemq queues`') end
local f = redis.call('HMGET', K.meta, 'seq', 'first', 'groups')
local seq, first = tonumber(f[1] or '0'), tonumber(f[2] or '1')
local groups = f[3] and split(f[3], '\n') or {}
local now = now_ms()

-- Delayed redeliveries per group, in one pass over the delayed set.
local delayed, stale = {}, {}
for _, member in ipairs(redis.call('ZRANGE', K.delayed, 0, -1)) do
  local g = string.match(member, '^([^%z]*)')
  delayed[g] = (delayed[g] or 0) + 1
  stale[#stale + 1] = member
end
for i = 1, #stale, 1000 do
  add_total(K, DELAYED, -redis.call('ZREM', K.delayed, unpack(stale, i, math.min(i + 999, #stale))))
end

local out = {}
for _, g in ipairs(groups) do
  local gs = redis.call('HMGET', K.meta, gf(g, CURSOR), gf(g, EPOCH))
  local cur = tonumber(gs[1] or first)
  if cur < first then cur = first end
  local unread = count_between(K.meta, cur, seq)
  if prio_on(K) then  -- what it has not read at any level (lib/priority.lua)
    unread = unread_by_level(K, g, cur)
    redis.call('HDEL', K.meta, gf(g, LEVEL_CURSORS))
  end
  local returned = redis.call('ZLEXCOUNT', K.ready, '[' .. g .. SEP, '(' .. g .. '\1')
  if returned > 0 then add_total(K, READY, -redis.call('ZREMRANGEBYLEX', K.ready, '[' .. g .. SEP, '(' .. g .. '\1')) end
  add_total(K, READY, -unread)
  local held = group_checkout_count(K, g)
  redis.call('HSET', K.meta, gf(g, CURSOR), seq + 1)
  local dropped = unread + returned + (delayed[g] or 0)
  journal(now, 'purge', g, nil, seq + 1, nil, gs[2], dropped)
  out[#out + 1] = g
  out[#out + 1] = cur
  out[#out + 1] = unread
  out[#out + 1] = returned
  out[#out + 1] = delayed[g] or 0
  out[#out + 1] = held
end
if #groups == 0 then journal(now, 'purge', nil, nil, seq + 1, nil, nil, 0) end
reclaim_if_idle(K, ttl)
flush_journal(K)
put_to_rest(K)
return {seq, out}
