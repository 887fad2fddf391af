-- take.lua: pop the next delivery from a member's push mailbox.
--@include lib/mailbox.lua
--@flags allow-oom
--
-- Returns: {'msg', …}, {'none', refill} or {'eos', gone} (in full after ARGV)
-- Errors: NOTFOUND, BADARG, STALE (in full after ARGV)
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
-- KEYS[11] mailbox        the member's
-- KEYS[12] totals         the broker's totals (lib/totals.lua)
-- KEYS[13] backlogs
-- KEYS[14] priority       a priority queue's index of levels (lib/priority.lua)
-- KEYS[15] rest           the slot's rest hash: an lmq at rest keeps its meta there (lib/meta.lua)
-- ARGV[1] group
-- ARGV[2] member
-- ARGV[3] default_lock_ms
-- ARGV[4] intent_at       the lease intent this call runs under (lua/lease_intent.lua)
-- ARGV[5] intent_ms       how old that intent may be
-- Returns, in full: {'msg', epoch, deadline, tag, id, acquisitions, body, refill},
--   {'none', refill} when there is nothing the member may take (empty, or the
--   member is fenced off or suspected: then the fence, 'evicted' or
--   'suspected', follows, and after it what its notice said: who took its
--   place (from its second poll after the eviction on), or the tags whose
--   leases ran out as the sweep's message_timeout named them; lib/members.lua,
--   fenced_news), or {'eos', gone} at the end of stream.
--   After a MAX the member stays, ended (gone = 0, and every TAKE after it
--   answers the same): its handle still settles (ACK, NACK, RENEW) what it
--   took; those come back to the group only by lease expiry or the session's
--   end. After an UNSUB the member is removed (gone = 1). refill = 1: a shared group's
--   member, to be refilled by dispatch.lua with the group's strategy.
-- The taken message's lease starts now; the mailbox is topped up in the same
-- call. See take_from_mailbox (lib/mailbox.lua) for what is dropped.
-- Errors, in full: NOTFOUND (not subscribed), BADARG (not a push subscription), STALE
--   (the lease intent is too old: nothing done).
-- Cost: O(skipped + messages topped up).
wake_from_rest(K)  -- an lmq at rest gets its meta key back first (lib/meta.lua)
local g, m = A.group, A.member
check_intent(A.intent_at, A.intent_ms)
local now = now_ms()
local taken, ep, deadline, status, polled_before = take_from_mailbox(K, K.mailbox, g, m, 1, now, A.default_lock_ms)
-- Members of a shared group are refilled by the group's strategy (dispatch),
-- never by their own TAKE: that would hand them other members' share.
local refill = redis.call('HGET', K.meta, gf(g, MODE)) == 'shared' and 1 or 0
flush_journal(K)
if (status == 'eos' or status == 'gone') and #taken == 0 then return {'eos', status == 'gone' and 1 or 0} end
local t = taken[1]
if not t then
  local none = {'none', refill}
  local news = fenced_news(K, g, m, status, polled_before)  -- what its notice said, to tell it again
  if #news > 0 then
    none[3] = status
    for _, item in ipairs(news) do none[#none + 1] = item end
  end
  return none
end
return {'msg', ep, deadline, t[1], t[2], t[3], t[4], refill}
