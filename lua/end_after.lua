-- end_after.lua: arm MAX on a member: end after n messages in total (UNSUB … MAX n).
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
-- KEYS[9] wake
-- KEYS[10] journal
-- KEYS[11] mailbox        the member's push mailbox
-- KEYS[12] totals         the broker's totals (lib/totals.lua)
-- KEYS[13] backlogs
-- KEYS[14] priority       a priority queue's index of levels (lib/priority.lua)
-- KEYS[15] rest           the slot's rest hash: an lmq at rest keeps its meta there (lib/meta.lua)
-- ARGV[1] group
-- ARGV[2] member
-- ARGV[3] max
-- Returns: 1 if the subscription has ended (n ≤ already delivered), else 0.
-- NATS semantics: n counts every message ever delivered to the member, so
-- arming n ≤ delivered ends at once; a push member gets its sentinel seated
-- by evict-offer in this same call; a pull member's PULLs return empty.
-- Errors: NOTFOUND (not subscribed), BADARG (n < 0).
-- Cost: O(messages dispatched).
wake_from_rest(K)  -- an lmq at rest gets its meta key back first (lib/meta.lua)
expand_meta(K.meta)  -- this fence writes meta: no field may be left to a default
local mb, g, m = K.mailbox, A.group, A.member
local n = int_arg(A.max, 'MAX')
if n < 0 then raise('BADARG', 'MAX must be 0 or more') end
local f = redis.call('HMGET', K.meta, mf(g, m, DELIVERED), mf(g, m, CAPACITY))
if not f[1] then raise('NOTFOUND', 'not subscribed to this queue any more; SUB again for a new handle') end
redis.call('HSET', K.meta, mf(g, m, MAX), n)
if f[2] then
  fill_mailbox(K, mb, g, m, now_ms())
  redis.call('SPUBLISH', K.wake, 'max')
end
flush_journal(K)
return tonumber(f[1]) >= n and 1 or 0
