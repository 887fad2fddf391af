-- pull.lua: check out up to COUNT messages for one member of a subscription.
--@include lib/mailbox.lua
--@flags allow-oom
--
-- KEYS[1] meta
-- KEYS[2] log
-- KEYS[3] checkouts
-- KEYS[4] deadlines
-- KEYS[5] owned
-- KEYS[6] held
-- KEYS[7] ready
-- KEYS[8] delayed
-- KEYS[9] journal
-- KEYS[10] mailbox         the member's push mailbox (a pull member has none)
-- ARGV[1] group
-- ARGV[2] member
-- ARGV[3] count
-- ARGV[4] default_lock_ms
-- ARGV[5] intent_at       the lease intent this call runs under (lua/lease_intent.lua)
-- ARGV[6] intent_ms       how old that intent may be
-- Returns: {epoch, deadline, status, refill, tag1, id1, acquisitions1, body1, ...}
--   status 'ok' with 0..count deliveries, or a fence that yields none:
--   'evicted' (preempted; its old checkouts go back to the queue),
--   'suspected' (a lease expired; settle or RENEW first), 'standby' (not the
--   active member), 'ended' (its MAX is reached, or a push member's end of
--   stream). deadline is the new leases' deadline, -1 when none were made.
--   A push member takes up to COUNT from its mailbox, as TAKE does one at a
--   time; refill = 1 when it is a shared group's member, for dispatch.lua.
-- Errors: NOTFOUND when the member is not subscribed; BADARG on a bad count;
--   STALE when the lease intent is too old (nothing done).
-- Cost: O(count + due delayed) — returned messages first, in id order, then
--   new ones from the cursor.
local g, m = A.group, A.member
local count = int_arg(A.count, 'COUNT', 1)
check_intent(A.intent_at, A.intent_ms)
local now = now_ms()

local function reply(ep, deadline, status, refill, taken)
  local out = {ep, deadline, status, refill}
  for _, t in ipairs(taken) do
    out[#out + 1] = t[1]
    out[#out + 1] = t[2]
    out[#out + 1] = t[3]
    out[#out + 1] = t[4]
  end
  flush_journal(K)
  return out
end

if read_meta(K.meta, {mf(g, m, CAPACITY)})[1] then
  local taken, ep, deadline, status = take_from_mailbox(K, K.mailbox, g, m, count, now, A.default_lock_ms)
  local refill = redis.call('HGET', K.meta, gf(g, MODE)) == 'shared' and 1 or 0
  if status == 'eos' or status == 'gone' then status = 'ended' end
  return reply(ep, deadline, #taken > 0 and 'ok' or status, refill, taken)
end

local status, ep, member
status, ep, member, count = delivery_gate(K, g, m, count)
if status ~= 'ok' then return reply(ep, -1, status, 0, {}) end
local deadline = now + lock_of(K, member, A.default_lock_ms)
local taken = check_out(K, g, m, count, ep, now, deadline, member.qos)
return reply(ep, #taken > 0 and deadline or -1, 'ok', 0, taken)
