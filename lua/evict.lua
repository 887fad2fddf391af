-- evict.lua: an operator fences a client off one subscription (force-evict).
--@include _common.lua
-- (every fence: KEYS[last] is the queue's journal)
--
-- KEYS[1] meta  KEYS[2] log  KEYS[3] checkouts  KEYS[4] deadlines  KEYS[5] owned
-- KEYS[6] ready  KEYS[7] wake channel
-- ARGV[1] group  ARGV[2] member  ARGV[3] who evicts (written in the marker)
-- Returns: checkouts returned to the queue, or -1 when the client is not a
--   member of this subscription.
-- Like a preemption without a new owner: the ownership is dropped, an
-- eviction marker is written (its PULLs return empty until it subscribes
-- again or its session ends) and its checkouts go back to the queue.
-- Cost: O(the member's checkouts).
local K = {meta = KEYS[1], log = KEYS[2], co = KEYS[3], dl = KEYS[4], own = KEYS[5], rd = KEYS[6], wake = KEYS[7], jr = KEYS[#KEYS]}
expand_meta(K.meta)  -- this fence writes meta: no field may be left to a default
local g, m = ARGV[1], ARGV[2]
if redis.call('HEXISTS', K.meta, mf(g, m, 'n')) == 0 then return -1 end
local returned = #return_member_checkouts(K, g, m)
redis.call('HSET', K.meta, mf(g, m, 'mk'), ARGV[3])
if redis.call('HGET', K.meta, gf(g, 'own')) == m then redis.call('HDEL', K.meta, gf(g, 'own')) end
journal(now_ms(), 'evict', g, m, nil, nil, nil, ARGV[3])
flush_journal(K)
if returned > 0 then redis.call('SPUBLISH', K.wake, 'evict') end
return returned
