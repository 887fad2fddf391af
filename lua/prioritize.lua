-- prioritize.lua: an operator sets a plain topic's queue to honour PUB … PRIORITY, or not
-- (lib/priority.lua; docs/protocol.md, "Priority").
--@include lib/leases.lua
--@flags none
--
-- KEYS[1] meta
-- KEYS[2] log
-- KEYS[3] priority       the queue's index of levels (lib/priority.lua)
-- KEYS[4] totals         the broker's totals (lib/totals.lua)
-- KEYS[5] backlogs
-- KEYS[6] rest           the slot's rest hash: an lmq at rest keeps its meta there (lib/meta.lua)
-- ARGV[1] on             1: honour priority; 0: do not
-- Returns: 1 when the setting changed, 0 when it was so already.
-- Only while the queue's log is empty (a new topic, or one whose every message was consumed and
-- trimmed): every message a priority queue holds must be in its index, and one that does not
-- honour priority must hold none there. A queue that does not exist yet is created (counted as a
-- queue, like a first SUB). Each group's level cursors go: its levels read from its cursor.
-- Errors: NOPRIORITY when the log holds messages (nothing changed); BADARG when on is not 0 or 1.
-- Cost: O(groups).
wake_from_rest(K)  -- an lmq at rest gets its meta key back first (lib/meta.lua)
local on = int_arg(A.on, 'on', 0, 1)
local was = redis.call('HGET', K.meta, 'prio') == '1'
if was == (on == 1) then return 0 end
if redis.call('HLEN', K.log) > 0 then
  raise('NOPRIORITY', 'priority is switched only while the queue\'s log is empty: let its groups drain it (a '
    .. 'retention policy keeps consumed messages: clear it first), then switch')
end
expand_meta(K.meta)
if redis.call('HSETNX', K.meta, 'first', 1) == 1 then count_queue(K, 1) end
redis.call('HSETNX', K.meta, 'seq', 0)
redis.call('HSETNX', K.meta, 'ct', now_ms())
local groups = redis.call('HGET', K.meta, 'groups')
for _, g in ipairs(groups and split(groups, '\n') or {}) do redis.call('HDEL', K.meta, gf(g, LEVEL_CURSORS)) end
redis.call('DEL', K.priority)
if on == 1 then redis.call('HSET', K.meta, 'prio', 1) else redis.call('HDEL', K.meta, 'prio') end
return 1
