-- lite_hold.lua: a client takes hold of one more lite subscription, within its quota.
--@include lib/base.lua
--
-- KEYS[1] bucket          the client's index bucket of the lmq (docs/data-model.md, "Sessions")
-- KEYS[2] counts          the client's lite subscriptions per topic, for the quota
-- ARGV[1] entry           the subscription's field in the bucket: group|lmq|topic
-- ARGV[2] topic
-- ARGV[3] quota           lite subscriptions one client may hold per topic
-- Returns: 1 when the client holds it now (indexed and counted), 0 when it
--   held it already (nothing written). The count is the number of the
--   client's index entries of the topic: whoever removes an entry counts it off.
-- Errors: LIMIT when the client already holds its quota of the topic's lmqs
--   (nothing written); BADARG on a bad quota.
-- Cost: O(1), one call in the client's slot for the quota check, the session
--   index and the count (the subscribe fence is another slot's call).
local quota = int_arg(A.quota, 'quota')
if redis.call('HEXISTS', K.bucket, A.entry) == 1 then return 0 end
local held = tonumber(redis.call('HGET', K.counts, A.topic) or '0')
if held >= quota then
  raise('LIMIT', 'the client holds ' .. int_str(held) .. ' lite subscriptions of ' .. A.topic
    .. ', the quota; unsubscribe some first')
end
redis.call('HSET', K.bucket, A.entry, '')
redis.call('HINCRBY', K.counts, A.topic, 1)
return 1
