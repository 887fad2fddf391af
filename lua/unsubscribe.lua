-- unsubscribe.lua: a member leaves its subscription (cancel or session end).
--@include _common.lua
-- (every fence: KEYS[last] is the queue's journal)
--@include _mailbox.lua
--
-- KEYS[1] meta  KEYS[2] log  KEYS[3] checkouts  KEYS[4] deadlines  KEYS[5] owned
-- KEYS[6] ready  KEYS[7] wake channel  KEYS[8] the member's push mailbox
-- ARGV[1] group  ARGV[2] member
-- ARGV[3] 'cancel' (UNSUB: a push member's mailbox is cleared and the
--   end-of-stream sentinel seated, so a blocked TAKE wakes with EOS; the
--   member goes when it TAKEs it) or 'leave' (session over: gone at once)
-- ARGV[4] idle TTL ms of an lmq (0 = plain topic)
-- KEYS[9] delayed  KEYS[10] dedup  KEYS[11] dedup ids  KEYS[12] dead letters (to reclaim an idle lmq)
-- Returns: {checkouts returned, owner after (or ''), 1 if the member was
--   removed now else 0}. Idempotent: leaving twice returns {0, owner, 0}.
-- All the member's checkouts go back to the queue at once, its marker and
-- state are removed (no marker outlives its member), and an exclusive or
-- single-active group hands ownership to the next member in arrival order.
-- The group itself, with its cursor and epoch, stays: it is durable.
-- Cost: O(the member's checkouts + members of the group).
local K = {meta = KEYS[1], log = KEYS[2], co = KEYS[3], dl = KEYS[4], own = KEYS[5], rd = KEYS[6], wake = KEYS[7],
           dly = KEYS[9], dd = KEYS[10], ddm = KEYS[11], dead = KEYS[12], jr = KEYS[#KEYS]}
expand_meta(K.meta)  -- this fence writes meta: no field may be left to a default
local mb, g, m = KEYS[8], ARGV[1], ARGV[2]
local f = redis.call('HMGET', K.meta, gf(g, 'mode'), gf(g, 'own'), mf(g, m, 'n'), mf(g, m, 'cap'), mf(g, m, 'end'))
local mode, owner = f[1], f[2]
if not f[3] then return {0, owner or '', 0} end

local returned = #return_member_checkouts(K, g, m)
redis.call('DEL', mb)
if ARGV[3] == 'cancel' and f[4] then
  seat_sentinel(K, mb, g, m, tonumber(f[4]))
  flush_journal(K)
  redis.call('SPUBLISH', K.wake, 'cancel')
  return {returned, owner or '', 0}
end
push_list_remove(K.meta, g, m)
owner = remove_member(K, g, m)
if returned > 0 then redis.call('SPUBLISH', K.wake, 'leave') end
journal(now_ms(), 'leave', g, m, nil, nil, nil, ARGV[3])
flush_journal(K)
reclaim_if_idle(K, tonumber(ARGV[4]))
return {returned, owner or '', 1}
