-- lib/shared.lua: shared subscriptions (MQTT 5.0 §4.8.2): each message of
-- a shared group goes to exactly one of its members, by the group's strategy.
--@include lib/mailbox.lua

-- The sticky member keeps the group until it leaves or ends; while its mailbox
-- is full the group waits (that is what keeps the order). When it is gone,
-- the first member with room takes the group over. Returns the member (nil:
-- none has room).
local function current_sticky(K, g, members, state, sticky)
  local gone = not sticky or redis.call('HEXISTS', K.meta, mf(g, sticky, DELIVERED)) == 0
    or redis.call('HEXISTS', K.meta, mf(g, sticky, ENDED)) == 1
  if gone then
    sticky = nil
    for _, m in ipairs(members) do if state[m].room > 0 then sticky = m; break end end
    if sticky then redis.call('HSET', K.meta, gf(g, STICKY), sticky) end
  end
  return sticky
end

-- How many messages round-robin or sticky can hand out now: the room of every
-- member, or the sticky member's.
local function room_of_group(strategy, members, state, sticky)
  if strategy == 'sticky' then
    local s = sticky and state[sticky]
    return s and math.max(s.room, 0) or 0
  end
  local total = 0
  for _, m in ipairs(members) do
    if state[m].room > 0 then total = total + state[m].room end
  end
  return total
end

-- Who gets each of the next `limit` messages under round-robin or sticky: a
-- list of members (one per message) and, for round-robin, the pointer after
-- each pick. Planned for the messages taken, not for the group's whole room:
-- members with room for a thousand cost a thousand picks per call otherwise
-- (a quarter of a dispatch of 100, measured). A plan's first k picks are
-- those of any longer plan, so the limit changes no pick.
local function plan_picks(strategy, members, state, rr, sticky, limit)
  local picks, pointer_after = {}, {}
  if strategy == 'sticky' then  -- (limit is at most its room: none without a sticky member)
    for i = 1, limit do picks[i] = sticky end
    return picks, pointer_after
  end
  local n, room, at, k = #members, {}, rr, 0
  for _, m in ipairs(members) do room[m] = state[m].room end
  while k < limit do
    local pick
    for step = 1, n do
      local i = ((at + step - 1) % n) + 1
      if room[members[i]] > 0 then pick = members[i]; at = i; break end
    end
    if not pick then break end
    k = k + 1
    picks[k] = pick
    pointer_after[k] = at  -- the pointer moves only past a member that was actually served
    room[pick] = room[pick] - 1
  end
  return picks, pointer_after
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
-- Round-robin and sticky take the next messages in one go and lease them out
-- per member (one lease_out and one RPUSH each); hash decides from each
-- message's body, one at a time.
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

  -- Hands `share` (checked out of the group, in id order) to member m.
  local function hand_out(m, share)
    local s = state[m]
    local deadline = leased and now + lock_of(K, s.member, default_lock) or nil
    lease_out(K, g, m, share, s.ep, now, deadline, s.member.qos)
    local entries = {}
    for i, t in ipairs(share) do
      entries[i] = mailbox_entry(t, s.ep)
      if deadline and string.sub(t[1], 1, 1) ~= 'q' and (first_deadline < 0 or deadline < first_deadline) then
        first_deadline = deadline
      end
    end
    redis.call('RPUSH', boxes[m], unpack(entries))
    sent = sent + #share
    s.room = s.room - #share
    s.member.delivered = s.member.delivered + #share
    if s.member.max and s.member.delivered >= tonumber(s.member.max) then
      seat_sentinel(K, boxes[m], g, m, tonumber(s.member.cap))
      s.room = 0
      return true  -- ended
    end
    return false
  end

  if strategy == 'hash' then
    while true do
      -- taken first (an expired message on the way is settled by take_next), then given
      -- back when its bucket's member has no room
      local taken = take_next(K, g, 1, now)
      if #taken == 0 then break end
      local bucket = tonumber(string.match(taken[1][4], '^%d+:%d:(%d+):') or '0')
      local pick = members[(bucket % n) + 1]
      if state[pick].room <= 0 then
        put_back(K, g, taken, 1)
        break
      end
      hand_out(pick, taken)
    end
  else
    -- a sticky member ended by its MAX hands the group over: another pass, at most one per member
    for _ = 1, n do
      if strategy == 'sticky' then sticky = current_sticky(K, g, members, state, sticky) end
      local wanted = room_of_group(strategy, members, state, sticky)
      local taken = take_next(K, g, wanted, now)
      local picks, pointer_after = plan_picks(strategy, members, state, rr, sticky, #taken)
      if #taken > 0 and pointer_after[#taken] then rr = pointer_after[#taken] end
      local shares, order = {}, {}
      for i, t in ipairs(taken) do
        local m = picks[i]
        if not shares[m] then shares[m] = {}; order[#order + 1] = m end
        shares[m][#shares[m] + 1] = t
      end
      local ended = false
      for _, m in ipairs(order) do
        if hand_out(m, shares[m]) then ended = true end
      end
      if not (strategy == 'sticky' and ended and #taken == wanted) then break end
    end
  end
  if strategy == 'round-robin' then redis.call('HSET', K.meta, gf(g, RR_POINTER), rr) end
  return sent, first_deadline
end

-- Retained messages are indexed by topic level, so a SUBSCRIBE reads only what its
-- filter can match (fences/retained.py walks it). A topic a/b/c is three edges of a
-- trie of levels, each 'parent path NUL level' in a lex-sorted set, the root's path
-- empty and every other path ending in '/': '\0a', 'a/\0b', 'a/b/\0c'. Returns the
-- edges, and the path (without its '/') each one leads to: 'a', 'a/b', 'a/b/c'.
local function retained_edges(topic)
  local edges, nodes, parent = {}, {}, ''
  for i, level in ipairs(split(topic, '/')) do
    edges[i] = parent .. SEP .. level
    nodes[i] = parent .. level
    parent = parent .. level .. '/'
  end
  return edges, nodes
end
