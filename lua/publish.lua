-- publish.lua: append a batch of messages to one queue's log.
--@include lib/retention.lua
--@include lib/lite.lua
--@include lib/waiters.lua
--@include lib/schedule.lua
--@flags none
--
-- Returns: {ids, push members, handed, handed here} (in full after ARGV)
-- Errors: BADARG, STALE, NOPRIORITY (in full after ARGV)
-- KEYS[1] meta
-- KEYS[2] log
-- KEYS[3] dedup           zset: dedup id scored by publish time
-- KEYS[4] dedup_ids       hash: dedup id -> message id
-- KEYS[5] wake            sharded pub/sub channel (same hash tag)
-- KEYS[6] dead
-- KEYS[7] journal
-- KEYS[8] checkouts       (checkouts … waiters: to hand the messages to waiting long polls)
-- KEYS[9] deadlines
-- KEYS[10] owned
-- KEYS[11] held           (and ready, delayed: read to trim what every group has settled)
-- KEYS[12] ready
-- KEYS[13] delayed
-- KEYS[14] waiters
-- KEYS[15] scheduled       (scheduled, scheduled_bodies: messages published for later, lib/schedule.lua)
-- KEYS[16] scheduled_bodies
-- KEYS[17] totals         the broker's totals (lib/totals.lua)
-- KEYS[18] backlogs
-- KEYS[19] priority       a priority queue's index of levels (lib/priority.lua)
-- KEYS[20] rest           the slot's rest hash: an lmq at rest keeps its meta there (lib/meta.lua)
-- ARGV[1] maxlen          messages kept at most, whatever their state (0 = no limit)
-- ARGV[2] maxage_ms       (0 = no limit)
-- ARGV[3] dedup_window_ms
-- ARGV[4] idle_ttl_ms     of an lmq (0 = a plain topic)
-- ARGV[5] journal_cap     (0 = off)
-- ARGV[6] keep            1: the topic has a retention policy (lib/retention.lua); 0: settled messages go
-- ARGV[7] maxbytes        (0 = no limit)
-- ARGV[8] spans           '' or 'i:n,…': the dedup id of message i covers messages i … i+n-1 (the others
--                         of its run carry none): one dedup entry for a whole batch (MPUB … ID)
-- ARGV[9] intent_at       '' or the lease intent this call runs under: then it hands what it
--                         appends to the queue's waiting long polls (lib/waiters.lua)
-- ARGV[10] intent_ms      how old that intent may be (an older one: no hand-off)
-- ARGV[11] default_lock_ms
-- ARGV[12] delay_ms        '' or DELAY: the messages are due this many ms from now (lib/schedule.lua)
-- ARGV[13] at_ms           '' or AT: the messages are due at this unix time (ms, Redis clock)
-- ARGV[14] max_delay_ms    how far ahead a message may be scheduled
-- ARGV[15] priority       '' or PRIORITY: the level (0–9) of every message of the call, on a queue set to
--                         honour priority (lib/priority.lua); '' there is level 0
-- ARGV[16] clock_ids      1: a queue that can be deleted and made again (an lmq, a filter queue): its
--                         ids start at the clock, not at 1 (lib/meta.lua, start_ids)
-- ARGV[17] local_wids     the waiter ids of the calling worker's long polls begin with this ('' = none)
-- ARGV[18..] messages     pairs: body (opaque, packed by the caller), dedup id ('' = none)
-- Returns, in full: {ids, push members, handed, handed here}: one message id per pair (a repeated dedup id
--   within the window returns the id of the first publish and stores
--   nothing; for a run, the ids the run was given, consecutive from it),
--   the queue's push members as 'group TAB member' lines (false when none) for
--   the worker to dispatch to, and handed: -1 when no long poll waits, 0 when
--   some wait but nothing was handed to them (no fresh intent given, or they
--   are fenced), else the earliest deadline of the leases handed out; handed here:
--   the hand-off's wake-up message when a long poll of the calling worker was among
--   those handed to ('' else), which that worker hands them without waiting for the
--   pub/sub copy (still published, for the others and if the reply is lost).
--   Scheduled (a due time after now): the ids are schedule ids ('s' and digits), the messages
--   wait in the schedule, nothing is appended, and handed is the due time; then this call
--   must run under a fresh lease intent (it listed the queue for the sweep).
-- Errors, in full: BADARG when the messages are not pairs, a span is malformed or runs
--   past the batch, a number is not an integer, or the due time is further ahead than
--   max_delay_ms; STALE when scheduling under a lease intent that is too old (nothing done);
--   NOPRIORITY when a PRIORITY is given for a queue not set to honour it (nothing done).
-- Then the log's head is trimmed (lib/retention.lua): without a policy, what
--   every group has settled; past the limits, whatever its state.
-- Cost: O(n + trimmed + groups · log n), trimming at most n + 100 old entries per call.
wake_from_rest(K)  -- an lmq at rest gets its meta key back first (lib/meta.lua)
expand_meta(K.meta)  -- this fence writes meta: no field may be left to a default
local maxlen = int_arg(A.maxlen, 'MAXLEN')
local maxage = int_arg(A.maxage_ms, 'MAXAGE')
local maxbytes = int_arg(A.maxbytes, 'MAXBYTES')
local window = int_arg(A.dedup_window_ms, 'dedup window')
local idle_ttl = int_arg(A.idle_ttl_ms, 'idle TTL')
local intent_at = A.intent_at ~= '' and int_arg(A.intent_at, 'lease intent')
local intent_ms = int_arg(A.intent_ms, 'lease intent ms')
local default_lock = int_arg(A.default_lock_ms, 'default lock ms', 1)
local max_delay = int_arg(A.max_delay_ms, 'max delay ms')
local now = now_ms()
local due = nil  -- a scheduled publish: when its messages are due
if A.delay_ms ~= '' then
  due = now + int_arg(A.delay_ms, 'DELAY', 0, max_delay)
elseif A.at_ms ~= '' then
  due = int_arg(A.at_ms, 'AT')
  if due > now + max_delay then
    raise('BADARG', 'AT is more than ' .. int_str(max_delay) .. ' ms ahead (max_delay_ms); schedule it nearer')
  end
end
if due and due <= now then due = nil end  -- due already: published now
local level = nil  -- PRIORITY: validated before anything is written
if A.priority ~= '' then
  level = int_arg(A.priority, 'PRIORITY', 0, LEVELS - 1)
  if not prio_on(K) then
    raise('NOPRIORITY', 'this queue does not honour PRIORITY: set it with `fencemq priority set TOPIC on` while '
      .. 'its log is empty (lite queues and filter subscriptions have no priority)')
  end
end
if due then check_intent(A.intent_at, A.intent_ms) end  -- the sweep must find it, whenever this worker dies
if #A.messages % 2 ~= 0 then raise('BADARG', 'publish takes (body, dedup id) pairs') end
local n = #A.messages / 2
local span_at = {}
if A.spans ~= '' then
  for item in string.gmatch(A.spans, '[^,]+') do
    local at, len = string.match(item, '^(%d+):(%d+)$')
    at, len = tonumber(at), tonumber(len)
    if not at or at < 1 or len < 1 or at + len - 1 > n then raise('BADARG', 'malformed dedup span ' .. item) end
    span_at[at] = len
  end
end

if window > 0 then
  local old = redis.call('ZRANGEBYSCORE', K.dedup, '-inf', now - window, 'LIMIT', 0, 100 + n)
  if #old > 0 then
    redis.call('ZREM', K.dedup, unpack(old))
    redis.call('HDEL', K.dedup_ids, unpack(old))
  end
end

local seq, fresh = 0, false  -- a scheduled publish gives no id: its release starts the queue's ids
if not due and n > 0 then seq, fresh = start_ids(K, now, A.clock_ids == '1') end
if fresh then  -- the queue's first message: it counts from now
  redis.call('HSET', K.meta, 'ct', now)
  count_queue(K, 1)
end
local first_new = seq + 1
local stamp = int_str(now) .. ':'
local ids, pairs_, np = {}, {}, 0
local sid_base = due and schedule_ids(K.meta, n)  -- scheduled: the schedule ids of the batch
local sids, sched_bodies = {}, {}
local skip_to = 0  -- a repeated run's members: their ids are the run's, nothing is stored
for i = 1, n do
  local body, dedup = A.messages[2 * i - 1], A.messages[2 * i]
  local existing = false
  if i <= skip_to then
    existing = true
  elseif dedup ~= '' then
    existing = redis.call('HGET', K.dedup_ids, dedup)
    if existing and span_at[i] then
      for j = 1, span_at[i] - 1 do ids[i + j] = id_after(existing, j) end
      skip_to = i + span_at[i] - 1
    end
  end
  if existing then
    if existing ~= true then ids[i] = existing end
  elseif due then
    local sid = 's' .. int_str(sid_base + i - 1)
    if level and level > 0 then sid = sid .. 'p' .. int_str(level) end  -- kept till it is due (lib/priority.lua)
    sids[#sids + 1] = sid
    sched_bodies[#sids] = stamp .. body
    if dedup ~= '' then
      redis.call('ZADD', K.dedup, now, dedup)
      redis.call('HSET', K.dedup_ids, dedup, sid)
    end
    ids[i] = sid
  else
    seq = seq + 1
    pairs_[np + 1] = seq  -- the id, as text below with the rest of the batch's
    pairs_[np + 2] = stamp .. body
    np = np + 2
    if dedup ~= '' then
      redis.call('ZADD', K.dedup, now, dedup)
      redis.call('HSET', K.dedup_ids, dedup, seq)
    end
    ids[i] = seq  -- written as text below, the batch's new ids at once
  end
end
if due then
  if #sids > 0 then
    store_scheduled(K, sids, sched_bodies, due)
    if redis.call('HSETNX', K.meta, 'first', 1) == 1 then
      redis.call('HSET', K.meta, 'ct', now)
      count_queue(K, 1)
    end
    redis.call('HSET', K.meta, 'wt', now, 'jcap', A.journal_cap)
    if journal_on(K, A.journal_cap) then journal(now, 'schedule', nil, nil, nil, sids[1], nil, #sids) end
    if idle_ttl > 0 then revive(K) end
    flush_journal(K)
  elseif n > 0 then
    redis.call('HSET', K.dedup_ids, A.messages[2], ids[1])  -- all repeats: as below
  end
  return {ids, false, due, ''}
end
if np == 0 then
  -- All repeats: written again as they are, so that a confirmation after this call (WAIT,
  -- WAITAOF: fences/durability.py) also covers the first publish, on whatever connection it ran.
  if n > 0 then redis.call('HSET', K.dedup_ids, A.messages[2], ids[1]) end
  return {ids, false, -1, ''}
end
-- the new ids are consecutive: their text is made in one go
local texts = int_strs(first_new, seq - first_new + 1)
local new_ids = journal_on(K, A.journal_cap) and {} or nil
for i = 1, n do
  local id = ids[i]
  if type(id) == 'number' then
    ids[i] = texts[id - first_new + 1]
    if new_ids then new_ids[#new_ids + 1] = id end
  end
end
for i = 1, np, 2 do pairs_[i] = texts[pairs_[i] - first_new + 1] end
if new_ids then journal_batch(now, 'pub', nil, nil, new_ids) end

redis.call('HSET', K.log, unpack(pairs_))
if prio_on(K) then index_messages(K, level or 0, first_new, seq) end
redis.call('HSET', K.meta, 'seq', seq, 'wt', now, 'jcap', A.journal_cap)
count_appended(K, seq - first_new + 1)

trim_log(K, n + 100, A.keep == '1', maxlen, maxage, maxbytes, now)

if idle_ttl > 0 then revive(K) end
local handed, wake, here = -1, seq, ''
if redis.call('EXISTS', K.waiters) == 1 then
  handed = 0
  if intent_at and now - intent_at <= intent_ms then
    local message, due, local_served = hand_off(K, now, default_lock, n + 16, seq, A.local_wids)
    if message then wake, handed = message, due end
    if local_served then here = message end
  end
end
flush_journal(K)
redis.call('SPUBLISH', K.wake, wake)
return {ids, redis.call('HGET', K.meta, 'push'), handed, here}
