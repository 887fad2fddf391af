-- ack.lua: settle checkouts of one member.
--@include lib/retention.lua
--@include lib/lite.lua
--@flags allow-oom
--
-- Returns: the number of checkouts settled (in full after ARGV)
-- Errors: BADARG (in full after ARGV)
-- KEYS[1] meta
-- KEYS[2] checkouts
-- KEYS[3] deadlines
-- KEYS[4] owned
-- KEYS[5] held
-- KEYS[6] ready
-- KEYS[7] delayed
-- KEYS[8] log             (log, dedup, dedup_ids and dead: only to reclaim an idle lmq)
-- KEYS[9] dedup
-- KEYS[10] dedup_ids
-- KEYS[11] dead
-- KEYS[12] journal
-- KEYS[13] wake
-- KEYS[14] totals         the broker's totals (lib/totals.lua)
-- KEYS[15] backlogs
-- KEYS[16] priority       a priority queue's index of levels (lib/priority.lua)
-- ARGV[1] group
-- ARGV[2] member
-- ARGV[3] idle_ttl_ms     of an lmq (0 = a plain topic)
-- ARGV[4] keep            1: the topic has a retention policy (lib/retention.lua); 0: settled messages go
-- ARGV[5] maxlen          messages kept at most, whatever their state (0 = no limit)
-- ARGV[6] maxage_ms       (0 = no limit)
-- ARGV[7] maxbytes        (0 = no limit)
-- ARGV[8..] tags
-- Returns, in full: the number of checkouts settled. A tag that is not (any more)
--   checked out to this member — past its deadline (swept or not yet),
--   redelivered, released by a seek, settled before — settles nothing.
--   Then the log's head is trimmed (lib/retention.lua): without a policy,
--   what every group has now settled, at most tags + 100 messages a call.
-- Errors, in full: BADARG when a retention limit is not an integer.
-- Cost: O(tags · log n + groups · log n), in a dozen Redis calls whatever the batch size.
local maxlen = int_arg(A.maxlen, 'MAXLEN')
local maxage = int_arg(A.maxage_ms, 'MAXAGE')
local maxbytes = int_arg(A.maxbytes, 'MAXBYTES')
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
local settled, owned, ids, id_tags, settled_ids = {}, {}, {}, {}, {}
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
      local id = string.sub(rec, head + 1, id_end - 1)
      settled_ids[#settled] = tonumber(id)
      if journaling then
        ids[#ids + 1] = id
        id_tags[#ids] = tags[i]
      end
    else
      local c = parse_checkout(tags[i], rec)
      if settles(c, g, m, epoch, dues[i], now) then
        settled[#settled + 1] = tags[i]
        owned[#owned + 1] = gm .. tags[i]
        settled_ids[#settled] = c.id
        journal(now, 'ack', g, m, c.id, c.tag, c.epoch)
      end
    end
  end
end
if journaling then journal_batch(now, 'ack', g, m, ids, id_tags, nil, epoch, nil, true) end
if #settled > 0 then
  remove_checkouts(K, settled, owned, size)
  tally(K, 'acked', #settled)
  forget_below_first(K, settled_ids)
  trim_log(K, #settled + 100, A.keep == '1', maxlen, maxage, maxbytes, now)
  reclaim_if_idle(K, tonumber(A.idle_ttl_ms), A.keep == '1')
  flush_journal(K)
end
-- Any settle attempt shows the consumer is alive: it is no longer suspected,
-- even when every tag it holds had expired (else it could never recover).
if clear_suspicion(K, g, m) then redis.call('SPUBLISH', K.wake, 'alive') end
return #settled
