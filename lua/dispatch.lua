-- dispatch.lua: fill the push mailboxes of some members of one queue.
--@include _common.lua
-- (every fence: KEYS[last] is the queue's journal)
--@include _mailbox.lua
--
-- KEYS[1..7] meta log checkouts deadlines owned ready delayed
-- KEYS[8] wake channel  KEYS[9..last-1] one mailbox per member named in ARGV
-- ARGV: group1, member1, group2, member2, ... (pairs, matching the mailboxes)
-- Returns: array of messages dispatched, one count per member (for a shared
--   group with a strategy, the group's total is reported on its first member).
-- Never beyond a mailbox's capacity (a full mailbox is back-pressure, not
-- loss) nor beyond the member's MAX; at MAX the sentinel is seated. Members
-- of a shared group are served by the group's strategy (see _mailbox.lua),
-- each message to exactly one of them.
-- Cost: O(messages dispatched · members of their group).
local K = {meta = KEYS[1], log = KEYS[2], co = KEYS[3], dl = KEYS[4], own = KEYS[5], rd = KEYS[6],
           dly = KEYS[7], wake = KEYS[8], jr = KEYS[#KEYS]}
expand_meta(K.meta)  -- this fence writes meta: no field may be left to a default
if #ARGV ~= 2 * (#KEYS - 9) then raise('BADARG', 'dispatch needs one mailbox key per (group, member)') end
local now = now_ms()
local counts, any = {}, false
local groups, order = {}, {}
for i = 1, #KEYS - 9 do
  local g = ARGV[2 * i - 1]
  if not groups[g] then
    groups[g] = {first = i, boxes = {}}
    order[#order + 1] = g
  end
  groups[g].boxes[ARGV[2 * i]] = KEYS[8 + i]
  counts[i] = 0
end
for _, g in ipairs(order) do
  local mode = redis.call('HGET', K.meta, gf(g, 'mode'))
  if mode == 'shared' then
    local n = dispatch_group(K, g, groups[g].boxes, now)
    counts[groups[g].first] = n
    if n > 0 then any = true end
  elseif mode then
    for i = 1, #KEYS - 9 do
      if ARGV[2 * i - 1] == g then
        -- a member that left meanwhile is skipped, not an error
        local ok, n = pcall(fill_mailbox, K, KEYS[8 + i], g, ARGV[2 * i], now)
        counts[i] = ok and n or 0
        if ok and n > 0 then any = true end
      end
    end
  end
end
flush_journal(K)
if any then redis.call('SPUBLISH', K.wake, 'dispatch') end
return counts
