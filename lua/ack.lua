-- ack.lua: settle checkouts of one member.
--@include lib/seek.lua
--@include lib/lite.lua
--@flags allow-oom
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
-- Cost: O(tags · log n), in at most seven Redis calls whatever the batch size.
local g, m = A.group, A.member
local tags, seen = {}, {}
for _, tag in ipairs(A.tags) do
  if not seen[tag] then
    seen[tag] = true
    tags[#tags + 1] = tag
  end
end
-- One read and three deletes for the whole batch, not a round of calls per tag.
local records, size = checkout_records(K, tags)
local now = now_ms()
-- A lease past its deadline settles nothing; when the queue has none, no
-- tag's deadline needs reading (nor parsing).
local dues = {}
if redis.call('ZCOUNT', K.deadlines, '-inf', now) > 0 then dues = redis.call('ZMSCORE', K.deadlines, unpack(tags)) end
local epoch = group_epoch(K.meta, g)
local settled, owned, ids, id_tags = {}, {}, {}, {}
local journaling = journal_on(K)
-- A record of this member under the group's epoch starts with `gm`, and
-- its epoch follows the id: compared as text, without parsing the record
-- (a record that does not match so takes the full parse below).
local gm = g .. SEP .. m .. SEP
local head, ep_text = #gm, SEP .. int_str(epoch) .. SEP
for i, rec in ipairs(records) do
  if rec and not (dues[i] and tonumber(dues[i]) <= now) then
    local id_end = string.sub(rec, 1, head) == gm and string.find(rec, SEP, head + 1, true)
    if id_end and string.sub(rec, id_end, id_end + #ep_text - 1) == ep_text then
      settled[#settled + 1] = tags[i]
      owned[#owned + 1] = gm .. tags[i]
      if journaling then
        ids[#ids + 1] = string.sub(rec, head + 1, id_end - 1)
        id_tags[#ids] = tags[i]
      end
    else
      local c = parse_checkout(tags[i], rec)
      if settles(c, g, m, epoch, dues[i], now) then
        settled[#settled + 1] = tags[i]
        owned[#owned + 1] = gm .. tags[i]
        journal(now, 'ack', g, m, c.id, c.tag, c.epoch)
      end
    end
  end
end
if journaling then journal_batch(now, 'ack', g, m, ids, id_tags, nil, epoch, nil, true) end
if #settled > 0 then
  remove_checkouts(K, settled, owned, size)
  reclaim_if_idle(K, tonumber(A.idle_ttl_ms))
  flush_journal(K)
end
-- Any settle attempt shows the consumer is alive: it is no longer suspected,
-- even when every tag it holds had expired (else it could never recover).
if clear_suspicion(K.meta, g, m) then redis.call('SPUBLISH', K.wake, 'alive') end
return #settled
