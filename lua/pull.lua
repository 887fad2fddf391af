-- pull.lua: check out up to COUNT messages for one member of a subscription.
--@include _common.lua
-- (every fence: KEYS[last] is the queue's journal)
--
-- KEYS[1] meta  KEYS[2] log  KEYS[3] checkouts  KEYS[4] deadlines  KEYS[5] owned
-- KEYS[6] ready  KEYS[7] delayed
-- ARGV[1] group  ARGV[2] member  ARGV[3] count  ARGV[4] default lock ms
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
local K = {meta = KEYS[1], log = KEYS[2], co = KEYS[3], dl = KEYS[4], own = KEYS[5], rd = KEYS[6], dly = KEYS[7], jr = KEYS[#KEYS]}
local g, m = ARGV[1], ARGV[2]
local count = int_arg(ARGV[3], 'COUNT')
if count < 1 then raise('BADARG', 'COUNT must be at least 1') end

local status, ep, member
status, ep, member, count = delivery_gate(K, g, m, count)
if member.cap then raise('BADARG', 'this is a PUSH subscription; TAKE from its mailbox instead of PULL') end
if status ~= 'ok' then
  flush_journal(K)
  return {ep, -1, status}
end

local now = now_ms()
local deadline = now + lock_of(K, member, ARGV[4])
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
