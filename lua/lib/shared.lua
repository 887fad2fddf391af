-- lib/shared.lua: shared subscriptions (MQTT 5.0 §4.8.2): each message of
-- a shared group goes to exactly one of its members, by the group's strategy.
--@include lib/mailbox.lua

-- The id of the message this group would check out next (ready first, then
-- the cursor), and its stored entry; nil when there is none.
local function peek_next(K, g)
  local r = redis.call('ZRANGEBYLEX', K.ready, '[' .. g .. SEP, '(' .. g .. '\1', 'LIMIT', 0, 1)
  if r[1] then
    local id = tonumber(split(r[1], SEP)[2])
    return id, redis.call('HGET', K.log, id)
  end
  local f = redis.call('HMGET', K.meta, gf(g, CURSOR), 'seq', 'first')
  local cur, last = math.max(tonumber(f[1] or '1'), tonumber(f[3] or '1')), tonumber(f[2] or '0')
  while cur <= last do
    local body = redis.call('HGET', K.log, cur)
    if body then return cur, body end
    cur = cur + 1
  end
  return nil
end

-- Shared group dispatch: each message goes to exactly one member, chosen by
-- the group's strategy among members with room in their mailbox:
--   round-robin  the next member after the last one served (arrival order)
--   sticky       the same member until it leaves (keeps order); when its
--                mailbox is full the group waits (back-pressure)
--   hash         members[hash bucket mod n]: a producer's (or topic's)
--                messages always go to one member, in order
-- A member whose session is offline gets no new share, unless the group was
-- created to queue for offline (durable) members (QUEUE-OFFLINE).
-- In a group with other members, what sits in a member's mailbox is leased
-- like any checkout, from the moment it is dispatched: a member that neither
-- TAKEs nor RENEWs it within its LOCK has it taken back by the sweep (and is
-- suspected and told), so a hung member cannot hold its share. A member
-- alone keeps its mailbox unleased until it TAKEs (exactly-N still holds
-- with nobody consuming). boxes: member -> mailbox key. Returns messages
-- sent and the earliest lease deadline made (-1 when none).
local function dispatch_group(K, g, boxes, now, default_lock)
  local f = redis.call('HMGET', K.meta, gf(g, STRATEGY), gf(g, QUEUE_OFFLINE), gf(g, RR_POINTER), gf(g, STICKY))
  local strategy, skip_offline, rr, sticky = f[1] or 'round-robin', f[2] ~= '1', tonumber(f[3] or '0'), f[4]
  local everyone = members_of(K.meta, g)
  local leased = #everyone > 1
  local first_deadline = -1
  local members, state = {}, {}
  for _, m in ipairs(everyone) do
    if boxes[m] then
      local status, ep, member, count = delivery_gate(K, g, m, 1000000)
      local room = 0
      if status == 'ok' and member.cap and not (skip_offline and not member.online) then
        room = math.min(count, tonumber(member.cap) - redis.call('LLEN', boxes[m]))
      end
      members[#members + 1] = m
      state[m] = {room = room, ep = ep, member = member, status = status}
    end
  end
  local n = #members
  if n == 0 then return 0 end
  local sent = 0
  while true do
    local pick, next_rr
    if strategy == 'sticky' then
      -- The sticky member keeps the group until it leaves or ends; while its
      -- mailbox is full the group waits (that is what keeps the order).
      local gone = not sticky or redis.call('HEXISTS', K.meta, mf(g, sticky, DELIVERED)) == 0
        or redis.call('HEXISTS', K.meta, mf(g, sticky, ENDED)) == 1
      if gone then
        sticky = nil
        for _, m in ipairs(members) do if state[m].room > 0 then sticky = m; break end end
        if sticky then redis.call('HSET', K.meta, gf(g, STICKY), sticky) end
      end
      if sticky and state[sticky] and state[sticky].room > 0 then pick = sticky end
    elseif strategy == 'hash' then
      local id, body = peek_next(K, g)
      if not id then break end
      local bucket = tonumber(string.match(body, '^%d+:%d:(%d+):') or '0')
      local m = members[(bucket % n) + 1]
      if state[m].room > 0 then pick = m end
    else
      for step = 1, n do
        local at = ((rr + step - 1) % n) + 1
        if state[members[at]].room > 0 then pick = members[at]; next_rr = at; break end
      end
    end
    if not pick then break end
    local s = state[pick]
    local deadline = leased and now + lock_of(K, s.member, default_lock) or nil
    local taken = check_out(K, g, pick, 1, s.ep, now, deadline, s.member.qos)
    if deadline and taken[1] and string.sub(taken[1][1], 1, 1) ~= 'q' and (first_deadline < 0 or deadline < first_deadline) then
      first_deadline = deadline
    end
    if #taken == 0 then break end
    -- the pointer moves only past a member that was actually served
    if next_rr then rr = next_rr end
    local t = taken[1]
    redis.call('RPUSH', boxes[pick], mailbox_entry(t, s.ep))
    s.room = s.room - 1
    sent = sent + 1
    s.member.delivered = s.member.delivered + 1
    if s.member.max and s.member.delivered >= tonumber(s.member.max) then
      seat_sentinel(K, boxes[pick], g, pick, tonumber(s.member.cap))
      s.room = 0
    end
  end
  if strategy == 'round-robin' then redis.call('HSET', K.meta, gf(g, RR_POINTER), rr) end
  return sent, first_deadline
end
