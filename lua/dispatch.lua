-- dispatch.lua: fill the push mailboxes of some members of one queue.
--@include _common.lua
-- (every fence: KEYS[last] is the queue's journal)
--@include _mailbox.lua
--
-- KEYS[1..7] meta log checkouts deadlines owned ready delayed
-- KEYS[8] wake channel  KEYS[9..last-1] one mailbox per member named in ARGV
-- ARGV: group1, member1, group2, member2, ... (pairs, matching KEYS[9..])
-- Returns: array of messages dispatched, one count per member.
-- Never beyond a mailbox's capacity (a full mailbox is back-pressure, not
-- loss) nor beyond the member's MAX; at MAX the sentinel is seated.
-- Cost: O(messages dispatched + members).
local K = {meta = KEYS[1], log = KEYS[2], co = KEYS[3], dl = KEYS[4], own = KEYS[5], rd = KEYS[6],
           dly = KEYS[7], wake = KEYS[8], jr = KEYS[#KEYS]}
if #ARGV ~= 2 * (#KEYS - 9) then raise('BADARG', 'dispatch needs one mailbox key per (group, member)') end
local now = now_ms()
local counts, any = {}, false
for i = 1, #KEYS - 9 do
  local g, m = ARGV[2 * i - 1], ARGV[2 * i]
  local ok, n = pcall(fill_mailbox, K, KEYS[8 + i], g, m, now)
  counts[i] = ok and n or 0  -- a member that left meanwhile is skipped, not an error
  if ok and n > 0 then any = true end
end
flush_journal(K)
if any then redis.call('SPUBLISH', K.wake, 'dispatch') end
return counts
