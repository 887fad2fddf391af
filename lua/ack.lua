-- ack.lua: settle checkouts of one member.
--@include _common.lua
-- (every fence: KEYS[last] is the queue's journal)
--
-- KEYS[1] meta  KEYS[2] checkouts  KEYS[3] deadlines  KEYS[4] owned
-- KEYS[5] ready  KEYS[6] delayed  KEYS[7] log  KEYS[8] dedup  KEYS[9] dedup ids  KEYS[10] dead letters
--   (the last four only to reclaim an idle lmq)
-- ARGV[1] group  ARGV[2] member  ARGV[3] idle TTL ms of an lmq (0 = plain)
-- ARGV[4..] delivery tags
-- Returns: the number of checkouts settled. A tag that is not (any more)
--   checked out to this member — expired, redelivered, released by a seek,
--   settled before — settles nothing.
-- Cost: O(tags · log n), in five Redis calls whatever the batch size.
local K = {meta = KEYS[1], co = KEYS[2], dl = KEYS[3], own = KEYS[4], rd = KEYS[5], dly = KEYS[6], log = KEYS[7],
           dd = KEYS[8], ddm = KEYS[9], dead = KEYS[10], jr = KEYS[#KEYS]}
local g, m = ARGV[1], ARGV[2]
local tags, seen = {}, {}
for i = 4, #ARGV do
  if not seen[ARGV[i]] then
    seen[ARGV[i]] = true
    tags[#tags + 1] = ARGV[i]
  end
end
-- One read and three deletes for the whole batch, not a round of calls per tag.
local records = redis.call('HMGET', K.co, unpack(tags))
local epoch = group_epoch(K.meta, g)
local settled, owned = {}, {}
local now
for i, rec in ipairs(records) do
  if rec then
    local c = parse_checkout(tags[i], rec)
    if c.group == g and c.member == m and c.epoch >= epoch then
      settled[#settled + 1] = tags[i]
      owned[#owned + 1] = g .. SEP .. m .. SEP .. tags[i]
      now = now or now_ms()
      journal(now, 'ack', g, m, c.id, c.tag, c.epoch)
    end
  end
end
if #settled > 0 then
  redis.call('HDEL', K.co, unpack(settled))
  redis.call('ZREM', K.dl, unpack(settled))
  redis.call('ZREM', K.own, unpack(owned))
  reclaim_if_idle(K, tonumber(ARGV[3]))
  flush_journal(K)
end
-- Any settle attempt shows the consumer is alive: it is no longer suspected,
-- even when every tag it holds had expired (else it could never recover).
clear_suspicion(K.meta, g, m)
return #settled
