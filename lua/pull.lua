-- pull.lua: check out up to COUNT messages for one member of a subscription.
--@include lib/mailbox.lua
--@include lib/waiters.lua
--@flags allow-oom
--
-- Returns: {epoch, deadline, status, refill, since, then 4 entries per delivery} (in full after ARGV)
-- Errors: NOTFOUND, BADARG, STALE (in full after ARGV)
-- KEYS[1] meta
-- KEYS[2] log
-- KEYS[3] checkouts
-- KEYS[4] deadlines
-- KEYS[5] owned
-- KEYS[6] held
-- KEYS[7] ready
-- KEYS[8] delayed
-- KEYS[9] journal
-- KEYS[10] mailbox        the member's push mailbox (a pull member has none)
-- KEYS[11] waiters        the queue's waiting long polls (lib/waiters.lua)
-- KEYS[12] wake           its channel ('leave' gives messages back: others may look)
-- KEYS[13] totals         the broker's totals (lib/totals.lua)
-- KEYS[14] backlogs
-- KEYS[15] priority       a priority queue's index of levels (lib/priority.lua)
-- KEYS[16] rest           the slot's rest hash: an lmq at rest keeps its meta there (lib/meta.lua)
-- ARGV[1] group
-- ARGV[2] member
-- ARGV[3] count
-- ARGV[4] default_lock_ms
-- ARGV[5] intent_at       the lease intent this call runs under (lua/lease_intent.lua)
-- ARGV[6] intent_ms       how old that intent may be
-- ARGV[7] look            '' for a PULL, or one look of a PULL … BLOCK (lib/waiters.lua): 'first'
--                         registers the waiter when it finds nothing (and answers since); 'again'
--                         and 'last' answer status 'handed' when the waiter's record is gone (a
--                         publish handed it messages), 'last' unregisters it; 'recover' answers
--                         the checkouts handed to it; 'leave' unregisters it and returns to the
--                         queue, unread, what was handed to it (status 'left' or 'released')
-- ARGV[8] wid             the waiter's id (unique per long poll)
-- ARGV[9] since           what 'first' answered
-- ARGV[10] wait_ms        how long the record lives ('first'): the BLOCK left, and a margin
-- Returns, in full: {epoch, deadline, status, refill, since, tag1, id1, acquisitions1, body1, ...}
--   status 'ok' with 0..count deliveries, or a fence that yields none:
--   'evicted' (preempted; its old checkouts go back to the queue; from its
--   second poll after the eviction on, who took its place, as its unsubscribe
--   notice named them, follows the head in place of deliveries), 'suspected'
--   (a lease expired; settle or RENEW first: the tags whose leases ran out, as
--   the sweep's message_timeout named them, follow the head in place of
--   deliveries, at most 100; lib/members.lua, fenced_news), 'standby' (not the
--   active member), 'ended' (its MAX is reached, or a push member's end of
--   stream). deadline is the new leases' deadline, -1 when none were made.
--   A push member takes up to COUNT from its mailbox, as TAKE does one at a
--   time; refill = 1 when it is a shared group's member, for dispatch.lua.
--   since is the queue's last tag when 'first' registered the waiter, else ''
--   (a push member is never registered: a publish fills its mailbox).
-- Errors, in full: NOTFOUND when the member is not subscribed; BADARG on a bad count;
--   STALE when the lease intent is too old (nothing done).
-- Cost: O(count + due delayed) — returned messages first, in id order, then
--   new ones from the cursor.
local woke = wake_from_rest(K)  -- an lmq at rest gets its meta key back first (lib/meta.lua)
local g, m = A.group, A.member
local count = int_arg(A.count, 'COUNT', 1)
check_intent(A.intent_at, A.intent_ms)
local now = now_ms()

local polled_before = false  -- an evicted member had polled since its eviction (lib/members.lua, fenced_news)
local function reply(ep, deadline, status, refill, taken, since)
  local out = {ep, deadline, status, refill, since or ''}
  for _, item in ipairs(fenced_news(K, g, m, status, polled_before)) do out[#out + 1] = item end  -- (no deliveries then)
  for _, t in ipairs(taken) do
    out[#out + 1] = t[1]
    out[#out + 1] = t[2]
    out[#out + 1] = t[3]
    out[#out + 1] = t[4]
  end
  flush_journal(K)
  if woke then put_to_rest(K) end  -- an empty poll of an lmq at rest leaves it at rest
  return out
end

if read_meta(K.meta, {mf(g, m, CAPACITY)})[1] then
  local taken, ep, deadline, status
  taken, ep, deadline, status, polled_before = take_from_mailbox(K, K.mailbox, g, m, count, now, A.default_lock_ms)
  local refill = redis.call('HGET', K.meta, gf(g, MODE)) == 'shared' and 1 or 0
  if status == 'eos' or status == 'gone' then status = 'ended' end
  return reply(ep, deadline, #taken > 0 and 'ok' or status, refill, taken)
end

local look = A.look
local status, ep, member, allowed = delivery_gate(K, g, m, count, true)
polled_before = member.polled_fenced
if look ~= '' and look ~= 'first' then
  local rec = waiter_record(A.wid, g, m, count, A.since)
  if look == 'recover' then return reply(ep, -1, 'ok', 0, handed_since(K, g, m, A.since)) end
  if look == 'leave' then
    if redis.call('ZREM', K.waiters, rec) == 1 then return reply(ep, -1, 'left', 0, {}) end
    for _, t in ipairs(handed_since(K, g, m, A.since)) do  -- as NACK … RELEASE: no failure counted
      local c = take_checkout(K, t[1])
      if c then
        requeue(K, c, c.fail)
        journal(now, 'nack', g, m, c.id, c.tag, c.epoch, c.fail)
      end
    end
    redis.call('SPUBLISH', K.wake, 'released')
    return reply(ep, -1, 'released', 0, {})
  end
  local present = look == 'last' and redis.call('ZREM', K.waiters, rec) == 1
    or look == 'again' and redis.call('ZSCORE', K.waiters, rec)
  if not present then return reply(ep, -1, 'handed', 0, {}) end
end
local taken = {}
if status == 'ok' then
  local deadline = now + lock_of(K, member, A.default_lock_ms)
  taken = check_out(K, g, m, allowed, ep, now, deadline, member.qos, true)
  if #taken > 0 then
    if look == 'again' then redis.call('ZREM', K.waiters, waiter_record(A.wid, g, m, count, A.since)) end
    return reply(ep, deadline, 'ok', 0, taken)
  end
end
if look == 'first' then
  local wait = int_arg(A.wait_ms, 'wait ms', 1)
  return reply(ep, -1, status, 0, {}, register_waiter(K, A.wid, g, m, count, now + wait, now))
end
return reply(ep, -1, status, 0, {})
