-- evict.lua: an operator fences a client off one subscription (force-evict).
--@include lib/lite.lua
--@flags allow-oom
--
-- KEYS[1] meta
-- KEYS[2] log
-- KEYS[3] checkouts
-- KEYS[4] deadlines
-- KEYS[5] owned
-- KEYS[6] held
-- KEYS[7] ready
-- KEYS[8] wake
-- KEYS[9] journal
-- KEYS[10] totals         the broker's totals (lib/totals.lua)
-- KEYS[11] backlogs
-- KEYS[12] rest           the slot's rest hash: an lmq at rest keeps its meta there (lib/meta.lua)
-- ARGV[1] group
-- ARGV[2] member
-- ARGV[3] by              who evicts (written in the marker)
-- Returns: checkouts returned to the queue, or -1 when the client is not a
--   member of this subscription.
-- Like a preemption without a new owner: the ownership is dropped, an
-- eviction marker is written (its PULLs return empty until it subscribes
-- again or its session ends) and its checkouts go back to the queue.
-- Errors: none of its own.
-- Cost: O(the member's checkouts).
wake_from_rest(K)  -- an lmq at rest gets its meta key back first (lib/meta.lua)
expand_meta(K.meta)  -- this fence writes meta: no field may be left to a default
local g, m = A.group, A.member
if redis.call('HEXISTS', K.meta, mf(g, m, DELIVERED)) == 0 then return -1 end
local returned = #mark_evicted(K, g, m, A.by, CHURN_EVICT)
if redis.call('HGET', K.meta, gf(g, OWNER)) == m then redis.call('HDEL', K.meta, gf(g, OWNER)) end
journal(now_ms(), 'evict', g, m, nil, nil, nil, A.by)
flush_journal(K)
if returned > 0 then redis.call('SPUBLISH', K.wake, 'evict') end
return returned
