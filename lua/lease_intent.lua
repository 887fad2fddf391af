-- lease_intent.lua: list a queue in the lease schedule before a fence makes leases there.
--@include lib/base.lua
--@flags allow-oom
--
-- KEYS[1] schedule        zset: queue id -> when its sweep is due
-- KEYS[2] intents         zset: queue id -> when a lease intent was last written
-- ARGV[1] qid
-- ARGV[2] lock_ms         the due time to list it at, from now, at the latest
-- Returns: now (ms): the intent's time, which the fence that makes the leases
--   is given and holds to (pull.lua, take.lua, dispatch.lua: STALE when older
--   than lease_intent_ms).
-- Why: the schedule is in another slot than the queue, so it cannot be written
--   in the fence itself, and a worker may die between the fence and the write
--   after it. With the intent first, the queue is listed whatever instant the
--   worker dies; the sweeper unlists a queue only when no intent is recent
--   enough for a fence to still run under it (unschedule.lua).
-- Errors: BADARG when lock_ms is not an integer.
local lock = int_arg(A.lock_ms, 'lock', 0)
local now = now_ms()
redis.call('ZADD', K.schedule, 'LT', now + lock, A.qid)
redis.call('ZADD', K.intents, now, A.qid)
return now
