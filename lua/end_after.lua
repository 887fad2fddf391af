-- end_after.lua: arm MAX on a member: end after n messages in total (UNSUB … MAX n).
--@include _common.lua
-- (every fence: KEYS[last] is the queue's journal)
--@include _mailbox.lua
--
-- KEYS[1..7] meta log checkouts deadlines owned ready delayed
-- KEYS[8] wake channel  KEYS[9] the member's push mailbox
-- ARGV[1] group  ARGV[2] member  ARGV[3] n
-- Returns: 1 if the subscription has ended (n ≤ already delivered), else 0.
-- NATS semantics: n counts every message ever delivered to the member, so
-- arming n ≤ delivered ends at once; a push member gets its sentinel seated
-- by evict-offer in this same call; a pull member's PULLs return empty.
-- Errors: NOTFOUND (not subscribed), BADARG (n < 0).
-- Cost: O(messages dispatched).
local K = {meta = KEYS[1], log = KEYS[2], co = KEYS[3], dl = KEYS[4], own = KEYS[5], rd = KEYS[6],
           dly = KEYS[7], wake = KEYS[8], jr = KEYS[#KEYS]}
expand_meta(K.meta)  -- this fence writes meta: no field may be left to a default
local mb, g, m = KEYS[9], ARGV[1], ARGV[2]
local n = int_arg(ARGV[3], 'MAX')
if n < 0 then raise('BADARG', 'MAX must be 0 or more') end
local f = redis.call('HMGET', K.meta, mf(g, m, 'n'), mf(g, m, 'cap'))
if not f[1] then raise('NOTFOUND', 'not subscribed to this queue any more; SUB again for a new handle') end
redis.call('HSET', K.meta, mf(g, m, 'max'), n)
if f[2] then
  fill_mailbox(K, mb, g, m, now_ms())
  redis.call('SPUBLISH', K.wake, 'max')
end
flush_journal(K)
return tonumber(f[1]) >= n and 1 or 0
