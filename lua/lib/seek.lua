-- lib/seek.lua: epochs and cursors. A group's epoch only grows; a checkout
-- taken under an older epoch is stale (ACK, NACK and RENEW of it settle
-- nothing), and moving a cursor is a seek: a new epoch, and nothing read
-- before it is delivered again.
--@include lib/leases.lua

-- A checkout taken under an epoch older than its group's is stale: ACK,
-- NACK and RENEW of it settle nothing.
local function group_epoch(meta, g)
  return tonumber(redis.call('HGET', meta, gf(g, EPOCH)) or '0')
end

-- Forget the group's returned and delayed messages: its cursor moved.
-- Cost: O(the queue's delayed messages).
local function clear_group_backlog(K, g)
  add_total(K, READY, -redis.call('ZREMRANGEBYLEX', K.ready, '[' .. g .. SEP, '(' .. g .. '\1'))
  local prefix = g .. SEP
  local stale = {}
  for _, member in ipairs(redis.call('ZRANGE', K.delayed, 0, -1)) do
    if string.sub(member, 1, #prefix) == prefix then stale[#stale + 1] = member end
  end
  if #stale > 0 then add_total(K, DELAYED, -redis.call('ZREM', K.delayed, unpack(stale))) end
end

local function published_at(body)
  return tonumber(string.match(body, '^(%d+):'))
end

-- First retained id published at or after `ms` (seq + 1 when none): a binary
-- search over the log, since ids are assigned in publish-time order. It
-- counts positions, gaps left out (lib/ids.lua).
local function first_at_or_after(K, first, seq, ms)
  local n = count_between(K.meta, first, seq)
  local lo, hi = 0, n
  while lo < hi do
    local mid = math.floor((lo + hi) / 2)
    local body = redis.call('HGET', K.log, position_after(K.meta, first, mid))
    if body and published_at(body) >= ms then hi = mid else lo = mid + 1 end
  end
  if lo == n then return seq + 1 end
  return position_after(K.meta, first, lo)
end

-- Move the group's cursor and raise its epoch: every checkout of the group
-- is released for good (its tag goes stale) and its returned and delayed
-- messages are forgotten. Returns the new epoch.
local function move_cursor(K, g, cur)
  release_group_checkouts(K, g, false)
  clear_group_backlog(K, g)
  local epoch = redis.call('HINCRBY', K.meta, gf(g, EPOCH), 1)
  local f = redis.call('HMGET', K.meta, gf(g, CURSOR), 'first', 'seq')
  local first, seq = tonumber(f[2] or '1'), tonumber(f[3] or '0')
  local before = tonumber(f[1] or first)
  if prio_on(K) then  -- every level's cursor moves to `cur` (lib/priority.lua)
    local unread = unread_by_level(K, g, math.max(before, first))
    redis.call('HDEL', K.meta, gf(g, LEVEL_CURSORS))
    add_total(K, READY, unread_of(K.meta, cur, first, seq) - unread)
  else
    add_total(K, READY, unread_of(K.meta, cur, first, seq) - unread_of(K.meta, before, first, seq))
  end
  redis.call('HSET', K.meta, gf(g, CURSOR), cur)
  return epoch
end
