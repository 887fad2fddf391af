-- lib/members.lua: a subscription's members and who may receive now. The
-- delivery gate is where the guarantees meet: a marked (evicted) member, a
-- suspected one, an ended one and a standby get nothing.
--@include lib/lite.lua

-- May this member become the active one of a single-active group? Not if it
-- is suspected, nor while its session has no connection.
local function can_take_over(meta, g, m)
  local f = read_meta(meta, {mf(g, m, DELIVERED), mf(g, m, SUSPECTED), mf(g, m, ONLINE)})
  return f[1] and not f[2] and f[3] ~= '0'
end

-- Remove a member from its group: fields and arrival-order slot. An
-- exclusive group loses its owner; a single-active one hands over to the next
-- member in arrival order that is not suspected. Returns the owner after.
-- A member that stops receiving (it left, or its stream ended) gives up the
-- ownership of an exclusive or single-active group: the next member in
-- arrival order that is not suspected takes a single-active group over.
-- Returns the owner after.
local function release_ownership(K, g, m)
  local f = redis.call('HMGET', K.meta, gf(g, MODE), gf(g, OWNER))
  local owner = f[2]
  if owner == m then
    owner = nil
    if f[1] == 'single-active' then
      for _, other in ipairs(members_of(K.meta, g)) do
        if other ~= m and can_take_over(K.meta, g, other) then owner = other; break end
      end
    end
    if owner then redis.call('HSET', K.meta, gf(g, OWNER), owner) else redis.call('HDEL', K.meta, gf(g, OWNER)) end
  end
  return owner
end

local function remove_member(K, g, m)
  uncount_member(K, g, m)
  for _, field in ipairs(MEMBER_FIELDS) do redis.call('HDEL', K.meta, mf(g, m, field)) end
  count_consumers(K, -1)
  local rest = {}
  for _, other in ipairs(members_of(K.meta, g)) do
    if other ~= m then rest[#rest + 1] = other end
  end
  set_members(K.meta, g, rest)
  return release_ownership(K, g, m)
end

-- May member m of group g receive messages now, and how many at most?
-- Returns status ('ok' or the fence that stops it), epoch, the member's
-- state fields, and the count allowed by its MAX. `polling`: the member asks
-- itself (a PULL), not a delivery meant for it.
local function delivery_gate(K, g, m, count, polling)
  local f = read_meta(K.meta, {gf(g, MODE), gf(g, EPOCH), gf(g, OWNER), mf(g, m, DELIVERED),
    mf(g, m, MAX), mf(g, m, MARKER), mf(g, m, SUSPECTED), mf(g, m, LOCK), mf(g, m, CAPACITY), mf(g, m, ENDED),
    mf(g, m, QOS), mf(g, m, ONLINE)})
  local mode, ep, owner = f[1], tonumber(f[2] or '0'), f[3]
  if not mode or not f[4] then raise('NOTFOUND', 'not subscribed to this queue any more; SUB again for a new handle') end
  local member = {lock = f[8], cap = f[9], ended = f[10], delivered = tonumber(f[4]), max = f[5],
                  qos = tonumber(f[11] or '1'), online = f[12] ~= '0'}
  if f[6] then
    -- Evicted: whatever it still holds goes back for the new owner.
    member.polled_fenced = fenced_off(K, g, m, ep, f[6], polling)
    return 'evicted', ep, member, 0
  end
  if f[7] then return 'suspected', ep, member, 0 end
  if f[10] then return 'ended', ep, member, 0 end
  if mode == 'exclusive' and owner ~= m then return 'standby', ep, member, 0 end
  if mode == 'single-active' and owner ~= m then
    -- Take over from an active member that is gone, suspected or
    -- disconnected: no deadlock, and no stall behind a dropped connection.
    if owner and can_take_over(K.meta, g, owner) then
      return 'standby', ep, member, 0
    end
    -- What the old active member still holds comes back first, so the group's
    -- order survives the handover (its late ACKs settle nothing).
    if owner and owner ~= m then return_member_checkouts(K, g, owner) end
    expand_meta(K.meta)
    redis.call('HSET', K.meta, gf(g, OWNER), m)
  end
  if f[5] then
    local left = tonumber(f[5]) - member.delivered
    if left <= 0 then return 'ended', ep, member, 0 end
    if left < count then count = left end
  end
  return 'ok', ep, member, count
end

-- What a poll (PULL, TAKE) that a fence stopped answers besides nothing, so
-- the worker can tell the member again what its notice said: a notice can be
-- lost (a failover, a worker's death), and a member that never hears it polls
-- empty for ever. Suspected: the tags whose leases ran out, as the sweep's
-- message_timeout named them (at most TIMED_OUT_KEPT); evicted: who took its
-- place, as its unsubscribe notice named them (the marker) — but not to its
-- first poll after the eviction (`polled_before`, from fenced_off): a client
-- that heard the notice may still have had that poll in flight, and only one
-- that polls on has missed it. Reads only.
local function fenced_news(K, g, m, status, polled_before)
  local out = {}
  if status == 'suspected' then
    for tag in string.gmatch(redis.call('HGET', K.meta, mf(g, m, TIMED_OUT)) or '', '%S+') do out[#out + 1] = tag end
  elseif status == 'evicted' and polled_before then
    out[1] = redis.call('HGET', K.meta, mf(g, m, MARKER))
  end
  return out
end

-- An act on the whole subscription (SEEK, UNSUB … MAX) is a member's, and
-- only an active one's: a client that is not a member (a handle it built
-- itself), one fenced off by a marker, one whose subscription has ended and
-- a standby of an exclusive or single-active group are refused, with the
-- code that says why. Reads only.
local function require_active_member(meta, g, m, verb)
  local f = read_meta(meta, {gf(g, MODE), gf(g, OWNER), mf(g, m, DELIVERED), mf(g, m, MARKER), mf(g, m, ENDED),
    mf(g, m, MAX)})
  local mode, owner = f[1], f[2]
  if not mode or not f[3] then
    raise('NOTFOUND', 'not a member of this subscription; ' .. verb .. ' is for its members (SUB first)')
  end
  if f[4] then
    raise('STALE', 'evicted from this subscription by ' .. f[4] .. '; SUB again to take it back before ' .. verb)
  end
  if f[5] or (f[6] and tonumber(f[3]) >= tonumber(f[6])) then
    raise('STALE', 'this subscription has ended (its MAX was reached); SUB again for a new one')
  end
  if (mode == 'exclusive' or mode == 'single-active') and owner ~= m then
    raise('NOPERM', 'only the active member of group ' .. g .. ' may ' .. verb .. '; this one is a standby')
  end
end
