-- drop_if_empty.lua: delete a queue whose subscriptions have no members left.
--@include lib/meta.lua
--@include lib/totals.lua
--@flags allow-oom
--
-- KEYS[1] meta
-- KEYS[2] totals          the broker's totals (lib/totals.lua): the queue's figures leave them
-- KEYS[3] backlogs
-- KEYS[4] rest           the slot's rest hash: an lmq at rest keeps its meta there (lib/meta.lua)
-- KEYS[5..] others        every other fixed key of the queue
-- ARGV: none
-- Returns: 1 if the queue was deleted, 0 if some group still has a member.
-- Used for MQTT filter subscriptions: a shared group lives while it has
-- members; when the last one leaves, the group and its undelivered messages
-- go (MQTT 5.0 §4.8.2).
-- Errors: none of its own.
-- Cost: O(groups + keys).
wake_from_rest(K)  -- an lmq at rest gets its meta key back first (lib/meta.lua)
local meta = K.meta
expand_meta(meta)  -- this fence writes meta: no field may be left to a default
local groups = redis.call('HGET', meta, 'groups')
for _, g in ipairs(groups and split(groups, '\n') or {}) do
  if redis.call('HEXISTS', meta, gf(g, MEMBERS)) == 1 then return 0 end
end
if redis.call('EXISTS', meta) == 1 then count_dropped(K) end
redis.call('DEL', meta, unpack(K.others))
return 1
