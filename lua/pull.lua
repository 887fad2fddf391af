-- pull.lua: check out up to COUNT messages for one member of a subscription.
--@include lib/members.lua
--
-- KEYS[1] meta
-- KEYS[2] log
-- KEYS[3] checkouts
-- KEYS[4] deadlines
-- KEYS[5] owned
-- KEYS[6] ready
-- KEYS[7] delayed
-- KEYS[8] journal
-- ARGV[1] group
-- ARGV[2] member
-- ARGV[3] count
-- ARGV[4] default_lock_ms
-- Returns: {epoch, deadline, status, tag1, id1, acquisitions1, body1, ...}
--   status 'ok' with 0..count deliveries, or a fence that yields none:
--   'evicted' (preempted; its old checkouts go back to the queue),
--   'suspected' (a lease expired; settle or RENEW first), 'standby' (not the
--   active member), 'ended' (its MAX is reached). deadline is the new leases'
--   deadline, -1 when none were made.
-- Errors: NOTFOUND when the member is not subscribed; BADARG on a bad count
--   or when the member is a push subscriber (it TAKEs from its mailbox).
-- Cost: O(count + due delayed) — returned messages first, in id order, then
--   new ones from the cursor.
local g, m = A.group, A.member
local count = int_arg(A.count, 'COUNT')
if count < 1 then raise('BADARG', 'COUNT must be at least 1') end

local status, ep, member
status, ep, member, count = delivery_gate(K, g, m, count)
if member.cap then raise('BADARG', 'this is a PUSH subscription; TAKE from its mailbox instead of PULL') end
if status ~= 'ok' then
  flush_journal(K)
  return {ep, -1, status}
end

local now = now_ms()
local deadline = now + lock_of(K, member, A.default_lock_ms)
local taken = check_out(K, g, m, count, ep, now, deadline, member.qos)
if #taken == 0 then return {ep, -1, 'ok'} end
flush_journal(K)
local out = {ep, deadline, 'ok'}
for _, t in ipairs(taken) do
  out[#out + 1] = t[1]
  out[#out + 1] = t[2]
  out[#out + 1] = t[3]
  out[#out + 1] = t[4]
end
return out
