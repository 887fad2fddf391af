-- renew.lua: extend the leases of one member's checkouts.
--@include _common.lua
--
-- KEYS[1] meta  KEYS[2] checkouts  KEYS[3] deadlines
-- ARGV[1] group  ARGV[2] member  ARGV[3] lock ms (0 = the member's or queue's)
-- ARGV[4] default lock ms  ARGV[5..] tags
-- Returns: {renewed, new deadline}. A tag no longer checked out to this
--   member renews nothing. Renewing anything clears suspicion.
-- Cost: O(tags · log n).
local K = {meta = KEYS[1], co = KEYS[2], dl = KEYS[3]}
local g, m = ARGV[1], ARGV[2]
local lock = int_arg(ARGV[3], 'LOCK')
if lock <= 0 then
  local f = redis.call('HMGET', K.meta, mf(g, m, 'lock'), 'lock')
  lock = tonumber(f[1] or f[2] or ARGV[4])
end
local deadline = now_ms() + lock
local renewed = 0
local epoch = group_epoch(K.meta, g)
for i = 5, #ARGV do
  local rec = redis.call('HGET', K.co, ARGV[i])
  if rec then
    local c = parse_checkout(ARGV[i], rec)
    if c.group == g and c.member == m and c.epoch >= epoch then
      redis.call('ZADD', K.dl, 'XX', deadline, ARGV[i])
      renewed = renewed + 1
    end
  end
end
clear_suspicion(K.meta, g, m)  -- alive, even if every tag had expired
return {renewed, deadline}
