-- renew.lua: extend the leases of one member's checkouts.
--@include lib/seek.lua
--@flags allow-oom
--
-- KEYS[1] meta
-- KEYS[2] checkouts
-- KEYS[3] deadlines
-- KEYS[4] owned           (a checkout renewed apart from its lease batch takes a lease of its own)
-- KEYS[5] held            (and its holding entry)
-- KEYS[6] wake
-- KEYS[7] totals          the broker's totals (lib/totals.lua: a suspicion cleared)
-- KEYS[8] backlogs
-- KEYS[9] rest           the slot's rest hash: an lmq at rest keeps its meta there (lib/meta.lua)
-- ARGV[1] group
-- ARGV[2] member
-- ARGV[3] lock_ms         0 = the member's or the queue's
-- ARGV[4] default_lock_ms
-- ARGV[5..] tags
-- Returns: {renewed, new deadline}. A tag no longer checked out to this
--   member renews nothing. Renewing anything clears suspicion.
-- Errors: BADARG when LOCK is not an integer.
-- Cost: O(tags · log n).
wake_from_rest(K)  -- an lmq at rest gets its meta key back first (lib/meta.lua)
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
local seen, in_batch, batches = {}, {}, {}
for _, tag in ipairs(A.tags) do
  local rec = not seen[tag] and redis.call('HGET', K.checkouts, tag)
  local c = rec and parse_checkout(tag, rec)
  if seen[tag] then
    if seen[tag] == 'renewed' then renewed = renewed + 1 end  -- named twice: renewed twice, as one by one
  elseif settles(c, g, m, epoch, c and deadline_of(K, c), now) then
    seen[tag] = 'renewed'
    if c.batch then  -- settled below, with the rest of its batch's
      if not in_batch[c.batch] then
        in_batch[c.batch] = {}
        batches[#batches + 1] = c.batch
      end
      table.insert(in_batch[c.batch], c)
    else
      -- (XX: a mailbox entry of a member alone, not yet leased, stays unleased)
      redis.call('ZADD', K.deadlines, 'XX', deadline, tag)
    end
    renewed = renewed + 1
  else
    seen[tag] = 'not'
  end
end
-- A lease batch renewed whole moves its one deadline; renewed in part, the
-- checkouts renewed leave it for leases of their own, the rest keep its deadline.
for _, key in ipairs(batches) do
  local cs = in_batch[key]
  if tonumber(redis.call('HGET', K.checkouts, key) or '0') == #cs then
    redis.call('ZADD', K.deadlines, 'XX', deadline, key)
  else
    for _, c in ipairs(cs) do lease_alone(K, c, deadline) end
  end
end
-- alive, even if every tag had expired: a long poll it has waiting may receive again
if clear_suspicion(K, g, m) then redis.call('SPUBLISH', K.wake, 'alive') end
return {renewed, deadline}
