-- ack.lua: settle checkouts of one member.
--@include lib/seek.lua
--@include lib/lite.lua
--
-- KEYS[1] meta
-- KEYS[2] checkouts
-- KEYS[3] deadlines
-- KEYS[4] owned
-- KEYS[5] ready
-- KEYS[6] delayed
-- KEYS[7] log             (log, dedup, dedup_ids and dead: only to reclaim an idle lmq)
-- KEYS[8] dedup
-- KEYS[9] dedup_ids
-- KEYS[10] dead
-- KEYS[11] journal
-- KEYS[12] wake
-- ARGV[1] group
-- ARGV[2] member
-- ARGV[3] idle_ttl_ms     of an lmq (0 = a plain topic)
-- ARGV[4..] tags
-- Returns: the number of checkouts settled. A tag that is not (any more)
--   checked out to this member — past its deadline (swept or not yet),
--   redelivered, released by a seek, settled before — settles nothing.
-- Errors: none of its own (a bad idle TTL is a caller's bug).
-- Cost: O(tags · log n), in five Redis calls whatever the batch size.
local g, m = A.group, A.member
local tags, seen = {}, {}
for _, tag in ipairs(A.tags) do
  if not seen[tag] then
    seen[tag] = true
    tags[#tags + 1] = tag
  end
end
-- One read and three deletes for the whole batch, not a round of calls per tag.
local records = redis.call('HMGET', K.checkouts, unpack(tags))
local dues = redis.call('ZMSCORE', K.deadlines, unpack(tags))
local epoch = group_epoch(K.meta, g)
local settled, owned = {}, {}
local now = now_ms()
for i, rec in ipairs(records) do
  local c = rec and parse_checkout(tags[i], rec)
  if settles(c, g, m, epoch, dues[i], now) then
    settled[#settled + 1] = tags[i]
    owned[#owned + 1] = g .. SEP .. m .. SEP .. tags[i]
    journal(now, 'ack', g, m, c.id, c.tag, c.epoch)
  end
end
if #settled > 0 then
  redis.call('HDEL', K.checkouts, unpack(settled))
  redis.call('ZREM', K.deadlines, unpack(settled))
  redis.call('ZREM', K.owned, unpack(owned))
  reclaim_if_idle(K, tonumber(A.idle_ttl_ms))
  flush_journal(K)
end
-- Any settle attempt shows the consumer is alive: it is no longer suspected,
-- even when every tag it holds had expired (else it could never recover).
if clear_suspicion(K.meta, g, m) then redis.call('SPUBLISH', K.wake, 'alive') end
return #settled
