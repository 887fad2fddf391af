-- take.lua: pop the next delivery from a member's push mailbox.
--@include _common.lua
-- (every fence: KEYS[last] is the queue's journal)
--@include _mailbox.lua
--
-- KEYS[1..7] meta log checkouts deadlines owned ready delayed
-- KEYS[8] wake channel  KEYS[9] the member's mailbox
-- ARGV[1] group  ARGV[2] member  ARGV[3] default lock ms
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
local K = {meta = KEYS[1], log = KEYS[2], co = KEYS[3], dl = KEYS[4], own = KEYS[5], rd = KEYS[6],
           dly = KEYS[7], wake = KEYS[8], jr = KEYS[#KEYS]}
expand_meta(K.meta)  -- this fence writes meta: no field may be left to a default
local mb, g, m = KEYS[9], ARGV[1], ARGV[2]
local f = redis.call('HMGET', K.meta, mf(g, m, 'n'), mf(g, m, 'cap'), mf(g, m, 'lock'), gf(g, 'ep'))
if not f[1] then raise('NOTFOUND', 'not subscribed to this queue any more; SUB again for a new handle') end
if not f[2] then raise('BADARG', 'this is not a PUSH subscription; PULL instead of TAKE') end
local now = now_ms()
-- Members of a shared group are refilled by the group's strategy (dispatch),
-- never by their own TAKE: that would hand them other members' share.
local refill = redis.call('HGET', K.meta, gf(g, 'mode')) == 'shared' and 1 or 0
if redis.call('HEXISTS', K.meta, mf(g, m, 'end')) == 0 then fill_mailbox(K, mb, g, m, now) end

local function deliver(entry)
  local p = split(string.sub(entry, 1, 200), SEP)
  local tag = p[1]
  local qos0 = string.sub(tag, 1, 1) == 'q'  -- at most once: no lease to start
  if not qos0 and redis.call('HEXISTS', K.co, tag) == 0 then return nil end  -- released meanwhile
  local deadline = -1
  if not qos0 then
    deadline = now + tonumber(f[3] or redis.call('HGET', K.meta, 'lock') or ARGV[3])
    redis.call('ZADD', K.dl, deadline, tag)
  end
  local header = #p[1] + #p[2] + #p[3] + #p[4] + 4
  return {'msg', tonumber(p[4]), deadline, tag, tonumber(p[2]), tonumber(p[3]), string.sub(entry, header + 1), refill}
end

local skipped, topped_up = false, false
while true do
  local entry = redis.call('LPOP', mb)
  if not entry and skipped and not topped_up and redis.call('HEXISTS', K.meta, mf(g, m, 'end')) == 0 then
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
    if redis.call('HEXISTS', K.meta, mf(g, m, 'end')) == 1 then
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
