-- lib/mailbox.lua: push mailboxes (bounded lists in Redis) and the graceful
-- max-N end. An entry is `tag NUL id NUL acquisitions NUL epoch NUL body`;
-- the end-of-stream sentinel is the entry 'EOS'. A message in a mailbox is
-- checked out to its member (record + ownership) but its lease starts only
-- when the member TAKEs it, so an unread mailbox never times out under it.
-- Helpers only: they use the including fence's K and the mailbox key it was
-- given in KEYS; they build no key names themselves.
--@include lib/members.lua

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
  redis.call('HSET', K.meta, mf(g, m, ENDED), 1)
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
  if redis.call('HGET', K.meta, gf(g, MODE)) == 'shared' then count = 0 end
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

