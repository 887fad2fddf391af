-- lib/lite.lua: exclusive lite queues. The eviction marker (member field
-- MARKER, naming who evicted it) fences a member off its lmq: its pulls get
-- nothing until it subscribes again or its session ends; markers never
-- expire by time. And the lifecycle of an lmq: consumed messages dropped,
-- reclaimed after an idle TTL, revived by a write.
--@include lib/leases.lua

-- Churn, kept without the journal (lmqs keep none by default, and the
-- analytics must still see preemptions): two group fields, written only
-- when churn happens, so an lmq that never churns carries nothing more.
-- CHURN = "preemptions,evictions,fenced pulls,first ms,last ms" (counters
-- since the group's first churn; a fenced pull counts once per eviction, as
-- the journal logs it); CHURN_WHO = the clients that held or took the group
-- around its churn, newline-separated, the first CHURN_WHO_MAX distinct ones
-- (a group flapping between two clients shows two). Read by the snapshot
-- (broker/fences/lite.py decodes it).
local CHURN, CHURN_WHO, CHURN_WHO_MAX = 'ch', 'chw', 8
local CHURN_PREEMPT, CHURN_EVICT, CHURN_FENCED = 1, 2, 3

local function count_churn(K, g, kind, now, names)
  local f = redis.call('HMGET', K.meta, gf(g, CHURN), gf(g, CHURN_WHO))
  local c = {0, 0, 0, now, now}
  if f[1] then
    local p = split(f[1], ',')
    for i = 1, 5 do c[i] = tonumber(p[i]) or c[i] end
  end
  c[kind] = c[kind] + 1
  c[5] = now
  local who = f[2] and split(f[2], '\n') or {}
  local seen = {}
  for _, w in ipairs(who) do seen[w] = true end
  for _, w in ipairs(names) do
    if w ~= '' and not seen[w] and #who < CHURN_WHO_MAX then
      who[#who + 1] = w
      seen[w] = true
    end
  end
  redis.call('HSET', K.meta, gf(g, CHURN), string.format('%d,%d,%d,%d,%d', c[1], c[2], c[3], c[4], c[5]),
    gf(g, CHURN_WHO), table.concat(who, '\n'))
end

-- Fence a member off: it is marked (by = who evicted it) and what it holds
-- goes back to the group; the churn is counted (kind: CHURN_PREEMPT when
-- `by` is the new owner, CHURN_EVICT for an operator's eviction). Returns
-- the tags returned.
local function mark_evicted(K, g, m, by, kind)
  local returned = return_member_checkouts(K, g, m)
  if redis.call('HSET', K.meta, mf(g, m, MARKER), by) == 1 then tally(K, 'fenced', 1) end
  count_churn(K, g, kind, now_ms(), kind == CHURN_PREEMPT and {m, by} or {m})
  return returned
end

-- A member that subscribes again is no longer fenced off: the fields its
-- subscribe deletes (with the rest it clears, in one HDEL).
local function marker_fields(g, m)
  return {mf(g, m, MARKER), mf(g, m, FENCE_LOGGED)}
end

-- A marked member tries to receive (its own poll, or a delivery meant for it:
-- a publish filling its mailbox, a group's dispatch, a hand-off to its long
-- poll): whatever it still holds goes back, and the attempt is journaled once
-- per eviction (a client polling in a loop must not flood the journal and push
-- the preempt event itself out of it). FENCE_LOGGED holds FENCED_TRIED once
-- journaled, FENCED_POLLED once the member has polled itself. Returns whether
-- it had polled since the eviction before this call (lib/members.lua,
-- fenced_news: only such a member has surely missed its notice).
local FENCED_TRIED, FENCED_POLLED = '1', '2'
local function fenced_off(K, g, m, ep, by, polling)
  return_member_checkouts(K, g, m)
  expand_meta(K.meta)
  local seen = redis.call('HGET', K.meta, mf(g, m, FENCE_LOGGED))
  if not seen then
    local now = now_ms()
    journal(now, 'fenced', g, m, nil, nil, ep, by)
    count_churn(K, g, CHURN_FENCED, now, {m})
  end
  if seen == FENCED_POLLED then return true end
  if polling or not seen then
    redis.call('HSET', K.meta, mf(g, m, FENCE_LOGGED), polling and FENCED_POLLED or FENCED_TRIED)
  end
  return false
end

-- Every key an lmq can have but mailboxes: what reclaiming it expires.
local LMQ_KEYS = {'meta', 'log', 'journal', 'dedup', 'dedup_ids', 'dead'}

-- An lmq at rest (docs/data-model.md, "Lmqs at rest") with nothing checked
-- out, returned or delayed:
-- * forgets the messages every group has read, so its log holds only what
--   someone may still get — at most 1000 per call (O(batch)) — unless its
--   topic has a retention policy (`keep`; lib/retention.lua). An lmq without groups keeps its messages
--   for its first subscriber, and one with a group that rewinds to the
--   earliest message on preemption keeps them for that rewind;
-- * is reclaimed after an idle TTL when nobody owns it or has anything left
--   to read: its keys get that expiry now, and lose it at the next write that
--   gives it an owner or a message to read (the caller passes the TTL for
--   lmqs only, 0 for plain topics, which are never reclaimed).
-- Then, nothing being checked out, its meta hash may come to rest compact.
-- One look at each group serves both. Cost: O(groups + messages dropped).
local function drop_consumed(K, first, upto)
  first = past_gap(K.meta, first)
  upto = run_end(K.meta, first, math.min(upto, first + 999))
  if upto < first then return end
  local ids = {}
  for id = first, upto do ids[#ids + 1] = id end
  redis.call('HDEL', K.log, unpack(ids))
  expand_meta(K.meta)
  local head = past_gap(K.meta, upto + 1)
  redis.call('HSET', K.meta, 'first', head)
  forget_gaps_below(K.meta, head)
end

local function reclaim_if_idle(K, ttl_ms, keep)
  if not ttl_ms or ttl_ms <= 0 then return end
  local settled = redis.call('HLEN', K.checkouts) == 0
  -- (dead letters wait for an operator: an lmq holding some is never reclaimed)
  local idle = settled and redis.call('ZCARD', K.ready) == 0 and redis.call('ZCARD', K.delayed) == 0
    and redis.call('LLEN', K.dead) == 0
  if idle then
    local top = read_meta(K.meta, {'seq', 'groups', 'first'})
    local seq, groups, first = tonumber(top[1] or '0'), top[2], tonumber(top[3] or '1')
    local read_by_all, rewinds = nil, false
    for _, g in ipairs(groups and split(groups, '\n') or {}) do
      local f = read_meta(K.meta, {gf(g, OWNER), gf(g, MEMBERS), gf(g, CURSOR), gf(g, ON_PREEMPT)})
      local cur = tonumber(f[3] or first)
      if f[1] or f[2] or count_between(K.meta, math.max(cur, first), seq) > 0 then idle = false end
      if f[4] == 'earliest' then rewinds = true end
      if not read_by_all or cur - 1 < read_by_all then read_by_all = cur - 1 end
    end
    if not groups and seq > 0 then idle = false end
    if read_by_all and not rewinds and not keep then drop_consumed(K, first, read_by_all) end
  end
  if settled then compact_meta(K.meta) end
  -- an lmq set to be reclaimed counts as gone; one that is not any more, back
  local armed = redis.call('PTTL', K.meta) >= 0
  if idle ~= armed then count_queue(K, idle and -1 or 1) end
  -- Every key an lmq can have but mailboxes (gone with their members).
  for _, name in ipairs(LMQ_KEYS) do
    local key = K[name]
    if key then
      if idle then redis.call('PEXPIRE', key, ttl_ms) else redis.call('PERSIST', key) end
    end
  end
end

-- A write that gives the queue an owner or a message revives it: no key may
-- keep the reclaim TTL (the caller declares all of LMQ_KEYS). The keys get
-- and lose it together, so a meta hash without a TTL means none has one
-- (expired keys are gone together too: the script's clock stands still).
local function revive(K)
  if redis.call('PTTL', K.meta) < 0 then return end
  count_queue(K, 1)
  for _, name in ipairs(LMQ_KEYS) do
    if K[name] then redis.call('PERSIST', K[name]) end
  end
end
