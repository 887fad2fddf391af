-- renew.lua: extend the leases of one member's checkouts.
--@include lib/seek.lua
--@flags allow-oom
--
-- KEYS[1] meta
-- KEYS[2] checkouts
-- KEYS[3] deadlines
-- KEYS[4] wake
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
if lock == 0 then
  local f = redis.call('HMGET', K.meta, mf(g, m, LOCK), 'lock')
  lock = tonumber(f[1] or f[2] or A.default_lock_ms)
end
local now = now_ms()
local deadline = now + lock
local renewed = 0
local epoch = group_epoch(K.meta, g)
for _, tag in ipairs(A.tags) do
  local rec = redis.call('HGET', K.checkouts, tag)
  local c = rec and parse_checkout(tag, rec)
  if settles(c, g, m, epoch, rec and redis.call('ZSCORE', K.deadlines, tag), now) then
    -- (XX: a mailbox entry of a member alone, not yet leased, stays unleased)
    redis.call('ZADD', K.deadlines, 'XX', deadline, tag)
    renewed = renewed + 1
  end
end
-- alive, even if every tag had expired: a long poll it has waiting may receive again
if clear_suspicion(K.meta, g, m) then redis.call('SPUBLISH', K.wake, 'alive') end
return {renewed, deadline}
