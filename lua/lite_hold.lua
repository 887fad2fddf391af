-- lite_hold.lua: a client takes hold of more lite subscriptions of one topic, within its quota.
--@include lib/base.lua
--@flags none
--
-- KEYS[1] counts          the client's lite subscriptions per topic, for the quota
-- KEYS[2..] buckets       the client's index bucket of each entry's lmq, in the entries' order (docs/data-model.md, "Sessions")
-- ARGV[1] topic
-- ARGV[2] quota           lite subscriptions one client may hold per topic
-- ARGV[3..] entries       per subscription two fields of its bucket, in the order of KEYS[2..]: the one
--                         it is held under (group|lmq|topic, the group empty when it is
--                         `default`), then the one an older entry of it may be under
--                         (default|lmq|topic; the same field for any other group)
-- Returns: one number per entry, in order: 1 when the client holds it now
--   (indexed and counted), 0 when it held it already, -1 when it would exceed
--   the quota (not held; the caller answers LIMIT). Nothing is written for a
--   0 or -1. The count is the number of the client's index entries of the
--   topic: whoever removes an entry counts it off.
--   An older entry counts as held (it is the same subscription; it stays as it is).
-- Errors: BADARG on a bad quota, or keys and entries that do not pair up
--   (nothing written).
-- Cost: O(entries), one call in the client's slot for the quota check, the
--   session index and the count (each subscribe fence is another slot's call).
local quota = int_arg(A.quota, 'quota')
if #A.entries ~= 2 * #K.buckets then raise('BADARG', 'one index bucket per entry and two fields per entry') end
local held = tonumber(redis.call('HGET', K.counts, A.topic) or '0')
local out, added = {}, 0
for i, bucket in ipairs(K.buckets) do
  local entry, older = A.entries[2 * i - 1], A.entries[2 * i]
  if redis.call('HEXISTS', bucket, entry) == 1 or (older ~= entry and redis.call('HEXISTS', bucket, older) == 1) then
    out[i] = 0
  elseif held >= quota then
    out[i] = -1
  else
    redis.call('HSET', bucket, entry, '')
    held, added, out[i] = held + 1, added + 1, 1
  end
end
if added > 0 then redis.call('HINCRBY', K.counts, A.topic, added) end
return out
