-- _mailbox.lua: push mailboxes (bounded lists in Redis). Include after
-- _common.lua. An entry is `tag NUL id NUL acquisitions NUL epoch NUL body`;
-- the end-of-stream sentinel is the entry 'EOS'. A message in a mailbox is
-- checked out to its member (record + ownership) but its lease starts only
-- when the member TAKEs it, so an unread mailbox never times out under it.
-- Helpers only: they use the including fence's K (meta, log, checkouts,
-- deadlines, owned, ready, delayed — all from its KEYS) and the mailbox key
-- it was given in KEYS; they build no key names themselves.

local EOS = 'EOS'

local function push_list_remove(meta, g, m)
  local list = redis.call('HGET', meta, 'push')
  if not list then return end
  local keep = {}
  for _, entry in ipairs(split(list, '\n')) do
    if entry ~= g .. '\t' .. m then keep[#keep + 1] = entry end
  end
  if #keep == 0 then redis.call('HDEL', meta, 'push') else redis.call('HSET', meta, 'push', table.concat(keep, '\n')) end
end

local function push_list_add(meta, g, m)
  local list = redis.call('HGET', meta, 'push')
  local entry = g .. '\t' .. m
  if not list then redis.call('HSET', meta, 'push', entry); return end
  for _, e in ipairs(split(list, '\n')) do if e == entry then return end end
  redis.call('HSET', meta, 'push', list .. '\n' .. entry)
end

-- Seat the end-of-stream sentinel by evict-offer: append if there is room,
-- else evict the oldest entry (its message goes back to the queue, not lost
-- to the subscription) and append. Never waits for the consumer.
local function seat_sentinel(K, mb, g, m, cap)
  if redis.call('LLEN', mb) >= cap then
    local oldest = redis.call('LPOP', mb)
    if oldest and oldest ~= EOS then
      local c = take_checkout(K, string.match(oldest, '^([^%z]*)'))
      if c then requeue(K, c, c.fail) end
    end
  end
  redis.call('RPUSH', mb, EOS)
  redis.call('HSET', K.meta, mf(g, m, 'end'), 1)
  journal(now_ms(), 'end', g, m)
  push_list_remove(K.meta, g, m)
end

-- Top the mailbox up to its capacity (and to MAX, seating the sentinel when
-- MAX is reached). Returns how many messages were dispatched.
local function fill_mailbox(K, mb, g, m, now)
  local status, ep, member, count = delivery_gate(K, g, m, 1000000)
  if not member.cap then return 0 end
  local cap = tonumber(member.cap)
  if status == 'ended' and not member.ended then
    seat_sentinel(K, mb, g, m, cap)
    return 0
  end
  if status ~= 'ok' then return 0 end
  local room = cap - redis.call('LLEN', mb)
  if room < count then count = room end
  -- a shared group's messages are handed out by its strategy (dispatch_group)
  if redis.call('HGET', K.meta, gf(g, 'mode')) == 'shared' then count = 0 end
  local taken = {}
  if count > 0 then taken = check_out(K, g, m, count, ep, now, nil, member.qos) end
  if #taken > 0 then
    local entries = {}
    for i, t in ipairs(taken) do entries[i] = table.concat({t[1], t[2], t[3], ep, t[4]}, SEP) end
    redis.call('RPUSH', mb, unpack(entries))
  end
  if member.max and member.delivered + #taken >= tonumber(member.max) then seat_sentinel(K, mb, g, m, cap) end
  return #taken
end

-- The id of the message this group would check out next (ready first, then
-- the cursor), and its stored entry; nil when there is none.
local function peek_next(K, g)
  local r = redis.call('ZRANGEBYLEX', K.rd, '[' .. g .. SEP, '(' .. g .. '\1', 'LIMIT', 0, 1)
  if r[1] then
    local id = tonumber(split(r[1], SEP)[2])
    return id, redis.call('HGET', K.log, id)
  end
  local f = redis.call('HMGET', K.meta, gf(g, 'cur'), 'seq', 'first')
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
-- Offline members keep their share queued in their mailbox, unless the group
-- skips offline members. boxes: member -> mailbox key. Returns messages sent.
local function dispatch_group(K, g, boxes, now)
  local f = redis.call('HMGET', K.meta, gf(g, 'strat'), gf(g, 'skip'), gf(g, 'rr'), gf(g, 'stk'))
  local strategy, skip_offline, rr, sticky = f[1] or 'round-robin', f[2] == '1', tonumber(f[3] or '0'), f[4]
  local members, state = {}, {}
  for _, m in ipairs(members_of(K.meta, g)) do
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
      local gone = not sticky or redis.call('HEXISTS', K.meta, mf(g, sticky, 'n')) == 0
        or redis.call('HEXISTS', K.meta, mf(g, sticky, 'end')) == 1
      if gone then
        sticky = nil
        for _, m in ipairs(members) do if state[m].room > 0 then sticky = m; break end end
        if sticky then redis.call('HSET', K.meta, gf(g, 'stk'), sticky) end
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
    local taken = check_out(K, g, pick, 1, s.ep, now, nil, s.member.qos)
    if #taken == 0 then break end
    -- the pointer moves only past a member that was actually served
    if next_rr then rr = next_rr end
    local t = taken[1]
    redis.call('RPUSH', boxes[pick], table.concat({t[1], t[2], t[3], s.ep, t[4]}, SEP))
    s.room = s.room - 1
    sent = sent + 1
    s.member.delivered = s.member.delivered + 1
    if s.member.max and s.member.delivered >= tonumber(s.member.max) then
      seat_sentinel(K, boxes[pick], g, pick, tonumber(s.member.cap))
      s.room = 0
    end
  end
  if strategy == 'round-robin' then redis.call('HSET', K.meta, gf(g, 'rr'), rr) end
  return sent
end
