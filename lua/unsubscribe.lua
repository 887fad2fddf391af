-- unsubscribe.lua: a member leaves its subscription (cancel or session end).
--@include lib/mailbox.lua
--@flags allow-oom
--
-- Returns: {checkouts returned, owner after, removed now, stays until EOS} (in full after ARGV)
-- Errors: none of its own (in full after ARGV)
-- KEYS[1] meta
-- KEYS[2] log
-- KEYS[3] checkouts
-- KEYS[4] deadlines
-- KEYS[5] owned
-- KEYS[6] held
-- KEYS[7] ready
-- KEYS[8] delayed
-- KEYS[9] wake
-- KEYS[10] dedup           (dedup, dedup_ids and dead: only to reclaim an idle lmq)
-- KEYS[11] dedup_ids
-- KEYS[12] dead
-- KEYS[13] journal
-- KEYS[14] mailbox        the member's push mailbox
-- KEYS[15] totals         the broker's totals (lib/totals.lua)
-- KEYS[16] backlogs
-- KEYS[17] priority       a priority queue's index of levels (lib/priority.lua)
-- KEYS[18] rest           the slot's rest hash: an lmq at rest keeps its meta there (lib/meta.lua)
-- ARGV[1] group
-- ARGV[2] member
-- ARGV[3] how             'cancel' (UNSUB: a push member's mailbox is cleared and
--   the end-of-stream sentinel seated, so a blocked TAKE wakes with EOS; the
--   member goes when it TAKEs it) or 'leave' (session over: gone at once)
-- ARGV[4] idle_ttl_ms     of an lmq (0 = a plain topic)
-- Returns, in full: {checkouts returned, owner after (or ''), 1 if the member was
--   removed now else 0, 1 if it stays until it TAKEs its end-of-stream
--   sentinel else 0}. Idempotent: leaving twice returns {0, owner, 0, 0}.
-- All the member's checkouts go back to the queue at once, its marker and
-- state are removed (no marker outlives its member), and an exclusive or
-- single-active group hands ownership to the next member in arrival order.
-- The group itself, with its cursor and epoch, stays: it is durable.
-- Errors, in full: none of its own.
-- Cost: O(the member's checkouts + members of the group).
wake_from_rest(K)  -- an lmq at rest gets its meta key back first (lib/meta.lua)
expand_meta(K.meta)  -- this fence writes meta: no field may be left to a default
local mb, g, m = K.mailbox, A.group, A.member
local f = redis.call('HMGET', K.meta, gf(g, MODE), gf(g, OWNER), mf(g, m, DELIVERED), mf(g, m, CAPACITY), mf(g, m, ENDED))
local mode, owner = f[1], f[2]
if not f[3] then return {0, owner or '', 0, 0} end

local returned = #return_member_checkouts(K, g, m)
redis.call('DEL', mb)
-- (a push member already at its end of stream just leaves)
if A.how == 'cancel' and f[4] and not f[5] then
  seat_sentinel(K, mb, g, m, tonumber(f[4]), 'unsub')
  flush_journal(K)
  redis.call('SPUBLISH', K.wake, 'cancel')
  return {returned, owner or '', 0, 1}
end
push_list_remove(K.meta, g, m)
owner = remove_member(K, g, m)
-- (always: a standby's long poll may be the new owner's now)
redis.call('SPUBLISH', K.wake, 'leave')
journal(now_ms(), 'leave', g, m, nil, nil, nil, A.how)
flush_journal(K)
reclaim_if_idle(K, tonumber(A.idle_ttl_ms))
put_to_rest(K)
return {returned, owner or '', 1, 0}
