-- lite_release.lua: a client lets go of a lite subscription (the inverse of lite_hold.lua).
--@include lib/base.lua
--@flags allow-oom
--
-- KEYS[1] bucket          the client's index bucket of the lmq
-- KEYS[2] counts          the client's lite subscriptions per topic
-- ARGV[1] entry           the subscription's field in the bucket: group|lmq|topic (group empty: `default`)
-- ARGV[2] older           the field an older entry of it may be under (default|lmq|topic; else = entry)
-- ARGV[3] topic
-- Returns: 1 when it was held (under either field) (out of the index, counted off; a count that
--   reaches 0 is deleted, as if never written), 0 when it was not (nothing written).
-- Errors: none of its own.
-- Cost: O(1).
local gone = redis.call('HDEL', K.bucket, A.entry)
if A.older ~= A.entry then gone = gone + redis.call('HDEL', K.bucket, A.older) end
if gone == 0 then return 0 end
if redis.call('HINCRBY', K.counts, A.topic, -1) <= 0 then redis.call('HDEL', K.counts, A.topic) end
return 1
