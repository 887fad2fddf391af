-- unschedule.lua: the sweeper unlists a queue with nothing pending, unless a lease intent is still in play.
--@include lib/base.lua
--@flags allow-oom
--
-- KEYS[1] schedule
-- KEYS[2] intents
-- ARGV[1] qid
-- ARGV[2] quiet_ms        how old the last intent must be: longer than any fence may run after it
-- Returns: 1 when unlisted, 0 when an intent is recent: the queue stays listed
--   until it is quiet (the sweep then looks again: a fence running under the
--   intent may have made a lease the sweep did not see).
-- Errors: BADARG when quiet_ms is not an integer.
local quiet = int_arg(A.quiet_ms, 'quiet', 0)
local now = now_ms()
local last = redis.call('ZSCORE', K.intents, A.qid)
if last and now - tonumber(last) < quiet then
  redis.call('ZADD', K.schedule, tonumber(last) + quiet, A.qid)
  return 0
end
redis.call('ZREM', K.schedule, A.qid)
redis.call('ZREM', K.intents, A.qid)
return 1
