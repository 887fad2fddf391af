-- dispatch.lua: fill the push mailboxes of some members of one queue.
--@include lib/shared.lua
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
-- KEYS[11] totals         the broker's totals (lib/totals.lua)
-- KEYS[12] backlogs
-- KEYS[13] priority       a priority queue's index of levels (lib/priority.lua)
-- KEYS[14] rest           the slot's rest hash: an lmq at rest keeps its meta there (lib/meta.lua)
-- KEYS[15..] mailboxes    one per member named in ARGV, in the same order
-- ARGV[1] default_lock_ms  the lease of a shared group's mailbox entries (lib/shared.lua)
-- ARGV[2] intent_at       the lease intent this call runs under (lua/lease_intent.lua)
-- ARGV[3] intent_ms       how old that intent may be
-- ARGV[4..] members       pairs: group, member
-- Returns: {counts, deadline}: messages dispatched, one count per member (for a
--   shared group the group's total is reported on its first member), and the
--   earliest lease deadline made (-1 when none), for the sweep's schedule.
-- Errors: BADARG when the mailboxes do not match the members; STALE when the
--   lease intent is too old (nothing done).
-- Never beyond a mailbox's capacity (a full mailbox is back-pressure, not
-- loss) nor beyond the member's MAX; at MAX the sentinel is seated. Members
-- of a shared group are served by the group's strategy (see lib/shared.lua),
-- each message to exactly one of them.
-- Cost: O(messages dispatched · members of their group).
wake_from_rest(K)  -- an lmq at rest gets its meta key back first (lib/meta.lua)
local boxes, who = K.mailboxes, A.members
if #who ~= 2 * #boxes then raise('BADARG', 'dispatch needs one mailbox key per (group, member)') end
local default_lock = int_arg(A.default_lock_ms, 'default lock', 1)
check_intent(A.intent_at, A.intent_ms)
expand_meta(K.meta)  -- validated: now the writes, with no field left to a default
local now = now_ms()
local deadline = -1
local counts, any = {}, false
local groups, order = {}, {}
for i = 1, #boxes do
  local g = who[2 * i - 1]
  if not groups[g] then
    groups[g] = {first = i, boxes = {}}
    order[#order + 1] = g
  end
  groups[g].boxes[who[2 * i]] = boxes[i]
  counts[i] = 0
end
for _, g in ipairs(order) do
  local mode = redis.call('HGET', K.meta, gf(g, MODE))
  if mode == 'shared' then
    local n, first = dispatch_group(K, g, groups[g].boxes, now, default_lock)
    counts[groups[g].first] = n
    if n > 0 then any = true end
    if first >= 0 and (deadline < 0 or first < deadline) then deadline = first end
  elseif mode then
    for i = 1, #boxes do
      if who[2 * i - 1] == g then
        -- a member that left meanwhile is skipped, not an error
        local ok, n = pcall(fill_mailbox, K, boxes[i], g, who[2 * i], now)
        counts[i] = ok and n or 0
        if ok and n > 0 then any = true end
      end
    end
  end
end
flush_journal(K)
if any then redis.call('SPUBLISH', K.wake, 'dispatch') end
return {counts, deadline}
