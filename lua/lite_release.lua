-- lite_release.lua: a client lets go of a lite subscription (the inverse of lite_hold.lua).
--@include lib/base.lua
--@flags allow-oom
--
-- KEYS[1] bucket          the client's index bucket of the lmq
-- KEYS[2] counts          the client's lite subscriptions per topic
-- ARGV[1] entry           the subscription's field in the bucket: group|lmq|topic
-- ARGV[2] topic
-- Returns: 1 when it was held (out of the index, counted off; a count that
--   reaches 0 is deleted, as if never written), 0 when it was not (nothing written).
-- Errors: none of its own.
-- Cost: O(1).
if redis.call('HDEL', K.bucket, A.entry) == 0 then return 0 end
if redis.call('HINCRBY', K.counts, A.topic, -1) <= 0 then redis.call('HDEL', K.counts, A.topic) end
return 1
