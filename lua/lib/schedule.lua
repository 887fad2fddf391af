-- lib/schedule.lua: scheduled messages (PUB … DELAY ms | AT unix-ms; docs/protocol.md,
-- "Scheduled messages"). A scheduled message is stored at once but outside the log: its
-- schedule id in K.scheduled (zset: schedule id scored by when it is due, ms, Redis clock) and
-- its stored body in K.scheduled_bodies (hash: schedule id -> body). When it is due,
-- release.lua appends it to the log as a new message, so every group that exists then reads it
-- as it reads any message, from its cursor: a SEEK, a group created later, a preemption before
-- that moment change nothing about who gets it, and the log's retention is not held by it.
-- The due set is swept as leases are: next_due (lib/leases.lua) includes its first entry, and
-- the sweeper releases what is due in O(due · log n).
--@include lib/retention.lua

-- Schedule ids for up to n messages: 's' and a number that only grows per queue (the tag
-- counter, which never falls behind Redis's clock in microseconds: lib/leases.lua), so an id is
-- never reused, even by a queue deleted and created again. Returns the first as a number.
local function schedule_ids(meta, n)
  return next_tags(meta, n) - n + 1
end

-- Store bodies (each stamped with its publish time) under their schedule ids, due at `due`.
-- O(n · log n).
local function store_scheduled(K, sids, bodies, due)
  if #sids == 0 then return end
  local members, pairs_ = {}, {}
  local due_text = int_str(due)
  for i, sid in ipairs(sids) do
    members[2 * i - 1] = due_text
    members[2 * i] = sid
    pairs_[2 * i - 1] = sid
    pairs_[2 * i] = bodies[i]
  end
  add_total(K, SCHEDULED, redis.call('ZADD', K.scheduled, unpack(members)))
  redis.call('HSET', K.scheduled_bodies, unpack(pairs_))
end

-- The id `j` places after `id` in a run of one dedup id (an MPUB … ID): a message id or a
-- schedule id.
local function id_after(id, j)
  if string.sub(id, 1, 1) == 's' then  -- 's<n>', or 's<n>p<level>' (a PRIORITY given: lib/priority.lua)
    local n, level = string.match(id, '^s(%d+)(.*)$')
    return 's' .. int_str(tonumber(n) + j) .. level
  end
  return int_str(tonumber(id) + j)
end

-- Cancel scheduled messages by schedule id: those not released yet are deleted. Returns how
-- many were. O(ids · log n).
local function cancel_scheduled(K, sids)
  local cancelled = 0
  for _, sid in ipairs(sids) do
    if redis.call('ZREM', K.scheduled, sid) == 1 then
      redis.call('HDEL', K.scheduled_bodies, sid)
      cancelled = cancelled + 1
    end
  end
  add_total(K, SCHEDULED, -cancelled)
  return cancelled
end

-- The due scheduled messages (at most `limit`, due at or before `upto`), taken off the
-- schedule: {sid, body} each, in due order (ties by schedule id: publish order).
local function take_due(K, upto, limit)
  local due = redis.call('ZRANGEBYSCORE', K.scheduled, '-inf', upto, 'LIMIT', 0, limit)
  if #due == 0 then return {} end
  local bodies = redis.call('HMGET', K.scheduled_bodies, unpack(due))
  add_total(K, SCHEDULED, -redis.call('ZREM', K.scheduled, unpack(due)))
  redis.call('HDEL', K.scheduled_bodies, unpack(due))
  local out = {}
  for i, sid in ipairs(due) do
    if bodies[i] then out[#out + 1] = {sid, bodies[i]} end
  end
  return out
end

-- When the next scheduled message is due (-1: none).
local function first_scheduled(K)
  local s = redis.call('ZRANGE', K.scheduled, 0, 0, 'WITHSCORES')
  return s[2] and tonumber(s[2]) or -1
end

-- A body stamped again with `now`: a released message enters the log at its time, so the log
-- stays in publish-time order (SEEK TIME's binary search) and its `ts` is when it became due.
local function restamp(body, now)
  local rest = string.match(body, '^%d+(:.*)$')
  return int_str(now) .. (rest or (':' .. body))
end
