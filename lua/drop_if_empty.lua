-- drop_if_empty.lua: delete a queue whose subscriptions have no members left.
--@include _common.lua
-- (every fence: KEYS[last] is the queue's journal)
--
-- KEYS[1..] every fixed key of the queue (meta first, journal last)
-- ARGV: none
-- Returns: 1 if the queue was deleted, 0 if some group still has a member.
-- Used for MQTT filter subscriptions: a shared group lives while it has
-- members; when the last one leaves, the group and its undelivered messages
-- go (MQTT 5.0 §4.8.2). Cost: O(groups + keys).
local meta = KEYS[1]
expand_meta(meta)  -- this fence writes meta: no field may be left to a default
local groups = redis.call('HGET', meta, 'groups')
for _, g in ipairs(groups and split(groups, '\n') or {}) do
  if redis.call('HEXISTS', meta, gf(g, 'mem')) == 1 then return 0 end
end
redis.call('DEL', unpack(KEYS))
return 1
