-- lib/expiry.lua: message expiry (PUB … TTL, MQTT's Message Expiry Interval), one rule for
-- every door: a message past its deadline is settled for a group without delivery, and counted.
--@include lib/journal.lua
--@include lib/totals.lua

-- Message expiry (PUB … TTL, MQTT's Message Expiry Interval): one rule for every door. A
-- message that expires carries the header mqtt-expires-ms (its deadline, ms on Redis's clock)
-- as its first header (broker/model/messages.py puts it there), so it is read here at a fixed
-- place, without scanning the payload. Returns the deadline, or nil (it never expires; the
-- older msgpack form never does here).
local function expires_at(body)
  -- the usual message has no headers ('R0'): told by a plain find and a byte, no pattern (0.5 us a
  -- message against 1.8 for the pattern below, on this loaded machine)
  local r = string.find(body, ':R', 1, true)
  if not r or string.byte(body, r + 2) == 48 then return nil end
  local n, plen, at = string.match(body, '^%d+:%d:%d+:R(%d+):(%d+):()')
  if not n or n == '0' then return nil end
  local pos = at + tonumber(plen)
  if string.sub(body, pos, pos + 10) == '$5\r\ntopic\r\n' then  -- a copy naming its source topic
    local len, after = string.match(body, '^%$(%d+)\r\n()', pos + 11)
    if not len then return nil end
    pos = after + tonumber(len) + 2
  end
  local ms = string.match(body, '^%$7\r\nheaders\r\n%%%d+\r\n%$15\r\nmqtt%-expires%-ms\r\n%$%d+\r\n(%d+)\r\n', pos)
  return ms and tonumber(ms)
end

local function expired(body, now)
  local at = expires_at(body)
  return at ~= nil and at <= now
end

-- n messages of group g were settled without delivery because they had expired: counted
-- (broker-wide and per entry, like published) and journaled.
local function count_expired(K, g, ids, now)
  local n = #ids
  if n == 0 then return end
  tally(K, 'expired', n)
  redis.call('HINCRBY', K.totals, 'expired|' .. queue_entry(K), n)
  if journal_on(K) then journal_batch(now, 'expire', g, nil, ids) end
end
