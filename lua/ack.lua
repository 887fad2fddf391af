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
-- KEYS[17] rest           the slot's rest hash: an lmq at rest keeps its meta there (lib/meta.lua)
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
wake_from_rest(K)  -- an lmq at rest gets its meta key back first (lib/meta.lua)
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
-- One read and a few deletes for the whole batch, not a round of calls per tag.
local records, size = checkout_records(K, tags)
local now = now_ms()
local epoch = group_epoch(K.meta, g)
local journaling = journal_on(K)
-- The member's own records under the group's epoch, each with its lease (a
-- batch's key, or its tag): a record that starts with `gm` and has the
-- group's epoch after its id is compared as text, not parsed (one that does
-- not match so takes the full parse below).
local gm = g .. SEP .. m .. SEP
local head, ep_text = #gm, SEP .. int_str(epoch) .. SEP
local id_of, lease_of_at, parsed = {}, {}, {}  -- by position in tags: the member's own only
local leases, lease_at = {}, {}  -- the distinct leases, and where each is in `leases`
local ep_len = #ep_text
local BATCH_MARK, by_tail = SEP .. 'b', {}
for i, rec in ipairs(records) do
  if rec then
    local lease = nil
    local id_end = string.sub(rec, 1, head) == gm and string.find(rec, SEP, head + 1, true)
    if id_end then
      -- what follows the id (epoch, acquisitions, failures, the batch's key) is the same text for
      -- most records of a call: read once per distinct text
      local tail = string.sub(rec, id_end)
      local known = by_tail[tail]
      if known == nil then
        known = false
        if string.sub(tail, 1, ep_len) == ep_text then
          -- a checkout of a lease batch ends with NUL and its key ('b…'; every other field is digits)
          local at = string.find(tail, BATCH_MARK, ep_len, true)
          known = at and string.sub(tail, at + 1) or ''
        end
        by_tail[tail] = known
      end
      if known then
        lease = known ~= '' and known or tags[i]
        id_of[i] = string.sub(rec, head + 1, id_end - 1)
      end
    end
    if not lease then
      local c = parse_checkout(tags[i], rec)
      if c and c.group == g and c.member == m and c.epoch >= epoch then
        lease, parsed[i], id_of[i] = lease_of(c), c, int_str(c.id)
      end
    end
    if lease then
      lease_of_at[i] = lease
      if not lease_at[lease] then
        leases[#leases + 1] = lease
        lease_at[lease] = #leases
      end
    end
  end
end
-- A lease past its deadline settles nothing; when the queue has none, no
-- lease's deadline needs reading.
local dues = {}
if #leases > 0 and redis.call('ZCOUNT', K.deadlines, '-inf', now) > 0 then
  dues = redis.call('ZMSCORE', K.deadlines, unpack(leases))
end
local settled, singles, batches, order, ids, id_tags, settled_ids = {}, {}, {}, {}, {}, {}, {}
for i = 1, #tags do
  local lease = lease_of_at[i]
  local due = lease and dues[lease_at[lease]]
  if lease and not (due and tonumber(due) <= now) then
    local tag = tags[i]
    settled[#settled + 1] = tag
    settled_ids[#settled] = tonumber(id_of[i])
    if lease == tag then singles[#singles + 1] = tag
    elseif batches[lease] then batches[lease] = batches[lease] + 1
    else
      batches[lease] = 1
      order[#order + 1] = lease
    end
    local c = parsed[i]
    if c then journal(now, 'ack', g, m, c.id, tag, c.epoch)
    elseif journaling then
      ids[#ids + 1] = id_of[i]
      id_tags[#ids] = tag
    end
  end
end
if journaling then journal_batch(now, 'ack', g, m, ids, id_tags, nil, epoch, nil, true) end
if #settled > 0 then
  remove_checkouts(K, g, m, settled, settled_ids, singles, batches, order, size)
  tally(K, 'acked', #settled)
  forget_below_first(K, settled_ids)
  trim_log(K, #settled + 100, A.keep == '1', maxlen, maxage, maxbytes, now)
  reclaim_if_idle(K, tonumber(A.idle_ttl_ms), A.keep == '1')
  flush_journal(K)
end
-- Any settle attempt shows the consumer is alive: it is no longer suspected,
-- even when every tag it holds had expired (else it could never recover).
if clear_suspicion(K, g, m) then redis.call('SPUBLISH', K.wake, 'alive') end
put_to_rest(K)  -- the last write: an lmq this ack (or nothing) left at rest gives up its key
return #settled
