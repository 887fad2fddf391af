-- renew.lua: extend the leases of one member's checkouts.
--@include lib/seek.lua
--
-- KEYS[1] meta
-- KEYS[2] checkouts
-- KEYS[3] deadlines
-- ARGV[1] group
-- ARGV[2] member
-- ARGV[3] lock_ms         0 = the member's or the queue's
-- ARGV[4] default_lock_ms
-- ARGV[5..] tags
-- Returns: {renewed, new deadline}. A tag no longer checked out to this
--   member renews nothing. Renewing anything clears suspicion.
-- Errors: BADARG when LOCK is not an integer.
-- Cost: O(tags · log n).
local g, m = A.group, A.member
local lock = int_arg(A.lock_ms, 'LOCK')
if lock <= 0 then
  local f = redis.call('HMGET', K.meta, mf(g, m, LOCK), 'lock')
  lock = tonumber(f[1] or f[2] or A.default_lock_ms)
end
local deadline = now_ms() + lock
local renewed = 0
local epoch = group_epoch(K.meta, g)
for _, tag in ipairs(A.tags) do
  local rec = redis.call('HGET', K.checkouts, tag)
  if rec then
    local c = parse_checkout(tag, rec)
    if c.group == g and c.member == m and c.epoch >= epoch then
      redis.call('ZADD', K.deadlines, 'XX', deadline, tag)
      renewed = renewed + 1
    end
  end
end
clear_suspicion(K.meta, g, m)  -- alive, even if every tag had expired
return {renewed, deadline}
