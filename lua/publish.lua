-- publish.lua: append a batch of messages to one queue's log.
--@include _common.lua
-- (every fence: KEYS[last] is the queue's journal)
--
-- KEYS[1] meta   KEYS[2] log   KEYS[3] dedup (zset)   KEYS[4] dedup ids (hash)
-- KEYS[5] wake channel (sharded pub/sub; same hash tag)  KEYS[6] dead letters
-- ARGV[1] max length to retain (0 = unbounded)
-- ARGV[2] max age to retain in ms (0 = unbounded)
-- ARGV[3] dedup window in ms
-- ARGV[4] idle TTL ms of an lmq (0 = plain topic)
-- ARGV[6] journal cap (0 = off)
-- ARGV[5] n, then (after ARGV[6]) n pairs: body (opaque, packed by the caller), dedup id ('' = none)
-- Returns: {ids, push members}: the n message ids (a repeated dedup id within
--          the window returns the id of the first publish and stores
--          nothing), and the queue's push members as 'group TAB member' lines
--          (false when none) for the worker to dispatch to.
-- Errors: BADARG when n does not match the arguments.
-- Cost: O(n + trimmed), trimming at most n + 100 old entries per call.
local K = {meta = KEYS[1], log = KEYS[2], dd = KEYS[3], ddm = KEYS[4], wake = KEYS[5], dead = KEYS[6], jr = KEYS[#KEYS]}
expand_meta(K.meta)  -- this fence writes meta: no field may be left to a default
local maxlen = int_arg(ARGV[1], 'MAXLEN')
local maxage = int_arg(ARGV[2], 'MAXAGE')
local window = int_arg(ARGV[3], 'dedup window')
local idle_ttl = int_arg(ARGV[4], 'idle TTL')
local n = int_arg(ARGV[5], 'batch size')
if #ARGV ~= 6 + 2 * n then raise('BADARG', 'publish batch declares ' .. n .. ' messages but carries ' .. (#ARGV - 6) / 2) end

local now = now_ms()
if window > 0 then
  local old = redis.call('ZRANGEBYSCORE', K.dd, '-inf', now - window, 'LIMIT', 0, 100 + n)
  if #old > 0 then
    redis.call('ZREM', K.dd, unpack(old))
    redis.call('HDEL', K.ddm, unpack(old))
  end
end

local seq = tonumber(redis.call('HGET', K.meta, 'seq') or '0')
local stamp = now .. ':'
local ids, pairs_ = {}, {}
for i = 1, n do
  local body, dedup = ARGV[5 + 2 * i], ARGV[6 + 2 * i]
  local existing = false
  if dedup ~= '' then existing = redis.call('HGET', K.ddm, dedup) end
  if existing then
    ids[i] = existing
  else
    seq = seq + 1
    pairs_[#pairs_ + 1] = seq
    pairs_[#pairs_ + 1] = stamp .. body
    if dedup ~= '' then
      redis.call('ZADD', K.dd, now, dedup)
      redis.call('HSET', K.ddm, dedup, seq)
    end
    ids[i] = tostring(seq)
    journal(now, 'pub', nil, nil, seq)
  end
end
if #pairs_ == 0 then return {ids, false} end

redis.call('HSET', K.log, unpack(pairs_))
if redis.call('HSETNX', K.meta, 'first', 1) == 1 then redis.call('HSET', K.meta, 'ct', now) end
redis.call('HSET', K.meta, 'seq', seq, 'wt', now, 'jcap', ARGV[6])

-- Retention trims from the head only, whatever the messages' state: a
-- consumer that later reaches a trimmed id skips it (documented in docs/).
if maxlen > 0 or maxage > 0 then
  local first = tonumber(redis.call('HGET', K.meta, 'first'))
  local budget = n + 100
  local start = first
  while budget > 0 and first <= seq do
    local drop = maxlen > 0 and seq - first + 1 > maxlen
    if not drop and maxage > 0 then
      local body = redis.call('HGET', K.log, first)
      drop = (not body) or published_at(body) < now - maxage
    end
    if not drop then break end
    redis.call('HDEL', K.log, first)
    first = first + 1
    budget = budget - 1
  end
  if first ~= start then redis.call('HSET', K.meta, 'first', first) end
end

if idle_ttl > 0 then revive(K) end
flush_journal(K)
redis.call('SPUBLISH', K.wake, seq)
return {ids, redis.call('HGET', K.meta, 'push')}
