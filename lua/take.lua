-- take.lua: pop the next delivery from a member's push mailbox.
--@include lib/mailbox.lua
--
-- KEYS[1] meta
-- KEYS[2] log
-- KEYS[3] checkouts
-- KEYS[4] deadlines
-- KEYS[5] owned
-- KEYS[6] ready
-- KEYS[7] delayed
-- KEYS[8] wake
-- KEYS[9] journal
-- KEYS[10] mailbox        the member's
-- ARGV[1] group
-- ARGV[2] member
-- ARGV[3] default_lock_ms
-- Returns: {'msg', epoch, deadline, tag, id, acquisitions, body, refill},
--   {'none', refill} when the mailbox is empty, or {'eos'} at the
--   end-of-stream sentinel — the member is then removed (its handle is
--   closed). refill = 1: a shared group's member, to be refilled by
--   dispatch.lua with the group's strategy, not by this call.
-- The taken message's lease starts now; the mailbox is topped up in the same
-- call. Entries whose checkout was released meanwhile (a seek, a preemption)
-- are skipped.
-- Errors: NOTFOUND (not subscribed), BADARG (not a push subscription).
-- Cost: O(skipped + messages topped up).
expand_meta(K.meta)  -- this fence writes meta: no field may be left to a default
local mb, g, m = K.mailbox, A.group, A.member
local f = redis.call('HMGET', K.meta, mf(g, m, DELIVERED), mf(g, m, CAPACITY), mf(g, m, LOCK), gf(g, EPOCH))
if not f[1] then raise('NOTFOUND', 'not subscribed to this queue any more; SUB again for a new handle') end
if not f[2] then raise('BADARG', 'this is not a PUSH subscription; PULL instead of TAKE') end
local now = now_ms()
-- Members of a shared group are refilled by the group's strategy (dispatch),
-- never by their own TAKE: that would hand them other members' share.
local refill = redis.call('HGET', K.meta, gf(g, MODE)) == 'shared' and 1 or 0
if redis.call('HEXISTS', K.meta, mf(g, m, ENDED)) == 0 then fill_mailbox(K, mb, g, m, now) end

local function deliver(entry)
  local p = split(string.sub(entry, 1, 200), SEP)
  local tag = p[1]
  local qos0 = string.sub(tag, 1, 1) == 'q'  -- at most once: no lease to start
  if not qos0 and redis.call('HEXISTS', K.checkouts, tag) == 0 then return nil end  -- released meanwhile
  local deadline = -1
  if not qos0 then
    deadline = now + tonumber(f[3] or redis.call('HGET', K.meta, 'lock') or A.default_lock_ms)
    redis.call('ZADD', K.deadlines, deadline, tag)
  end
  local header = #p[1] + #p[2] + #p[3] + #p[4] + 4
  return {'msg', tonumber(p[4]), deadline, tag, tonumber(p[2]), tonumber(p[3]), string.sub(entry, header + 1), refill}
end

local skipped, topped_up = false, false
while true do
  local entry = redis.call('LPOP', mb)
  if not entry and skipped and not topped_up and redis.call('HEXISTS', K.meta, mf(g, m, ENDED)) == 0 then
    -- Everything left was released (a seek, a preemption): what is ready now
    -- may take the room it made.
    topped_up = true
    fill_mailbox(K, mb, g, m, now)
    entry = redis.call('LPOP', mb)
  end
  if not entry then
    flush_journal(K)
    return {'none', refill}
  end
  if entry == EOS then
    -- A sentinel from before the member subscribed again is not its end.
    if redis.call('HEXISTS', K.meta, mf(g, m, ENDED)) == 1 then
      return_member_checkouts(K, g, m)
      push_list_remove(K.meta, g, m)
      remove_member(K, g, m)
      redis.call('DEL', mb)
      journal(now, 'eos', g, m)
      flush_journal(K)
      return {'eos'}
    end
  else
    local reply = deliver(entry)
    if reply then
      fill_mailbox(K, mb, g, m, now)
      flush_journal(K)
      return reply
    end
    skipped = true
  end
end
