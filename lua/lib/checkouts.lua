-- lib/checkouts.lua: a checkout's record, its lease batch, and the holding
-- index. A checkout is a record (K.checkouts: tag -> record), a lease, and a
-- holding entry (K.held) scored by the lowest message id it holds, so the
-- lowest id still checked out is found in O(log n) (lib/retention.lua): a
-- checkout with a lease of its own is there by its tag; a lease batch whose
-- ids rise with its tags (any batch but a priority queue's) by its key, its
-- score moved to its next checkout's id when the lowest goes (batch_low_gone);
-- any other batch by each of its tags. A lease is a deadline (K.deadlines:
-- scored by ms, absent while it waits in a push mailbox) and an ownership
-- entry (K.owned, lex: group NUL member NUL lease), so a member's checkouts
-- are found in O(its own). The lease of a checkout alone is its tag. The
-- checkouts one PULL makes share one lease, a *lease batch*: its key
-- 'b<first tag>+<span>' is the deadline's member and the ownership entry's
-- last field, and K.checkouts counts the batch's checkouts left under that
-- key; each record names its batch. A settled checkout leaves its batch, the
-- last one takes the batch's lease with it; a renewed or taken one leaves it
-- for a lease of its own; the batch expires as a unit, each checkout keeping
-- its own tag. Checkouts are made by lib/leases.lua (lease_out).
--@include lib/base.lua
--@include lib/totals.lua
--
-- Encodings (docs/data-model.md; broker/model/records.py reads them):
--   checkout record  group NUL member NUL id NUL epoch NUL acquisitions NUL failures
--                    [NUL batch key]: a checkout of a lease batch
--   batch key        'b' first tag '+' span (last tag - first; K.checkouts: the batch's checkouts left)
--   owned member     group NUL member NUL lease (a tag, or a batch key)

local function batch_key(first, span)
  return 'b' .. int_str(first) .. '+' .. int_str(span)
end

-- The batch key a record's tail (what follows its failures: '' or NUL batch
-- key) names, '' when the checkout has a lease of its own, nil when the tail
-- does not parse.
local function batch_of(tail)
  if tail == '' then return '' end
  return string.match(tail, '^%z(b%d+%+%d+)$')
end

-- A checkout record, or nil when it does not parse (then nothing may be
-- done with it: no fence deletes what it cannot read).
local function parse_checkout(tag, rec)
  local g, m, id, ep, acq, fail, tail = string.match(rec, '^([^%z]*)%z([^%z]*)%z(%d+)%z(%d+)%z(%d+)%z(%d+)(.*)$')
  if not fail then return nil end
  local batch = batch_of(tail)
  if not batch then return nil end
  return {tag = tag, group = g, member = m, id = tonumber(id), epoch = tonumber(ep),
          acq = tonumber(acq), fail = tonumber(fail), batch = batch ~= '' and batch or nil}
end

-- A checkout's lease: its batch's key, or its own tag.
local function lease_of(c)
  return c.batch or c.tag
end

-- A checkout's lease deadline (false when it has none: unleased in a mailbox).
local function deadline_of(K, c)
  return redis.call('ZSCORE', K.deadlines, lease_of(c))
end

-- The first checkout still in batch `key`, from tag `from` up, for which
-- `stop(c)` is true (nil: none), its records read 16 at a time.
local function scan_batch(K, key, from, stop)
  local first, span = string.match(key, '^b(%d+)%+(%d+)$')
  local last = tonumber(first) + tonumber(span)
  from = from or tonumber(first)
  while from <= last do
    local range = int_strs(from, math.min(16, last - from + 1))
    for j, rec in ipairs(redis.call('HMGET', K.checkouts, unpack(range))) do
      local c = rec and parse_checkout(range[j], rec)
      if c and c.batch == key and stop(c) then return c end
    end
    from = from + #range
  end
  return nil
end

local function any_checkout() return true end

-- Batch `key` (not emptied) lost its checkout at tag `gone`, the one whose id
-- scored its holding entry: its ids rise with its tags, so its lowest is now
-- that of the first tag above `gone` whose record still names the batch.
-- Scores only rise, so a batch's tags are scanned about once over its life.
local function batch_low_gone(K, key, gone)
  local c = scan_batch(K, key, tonumber(gone) + 1, any_checkout)
  if c then redis.call('ZADD', K.held, 'XX', int_str(c.id), key) end
end

-- `k` checkouts of batch `key` (group g, member m) are gone: the batch counts
-- them off, and its lease and holding entry go with its last. `c` (when k is
-- 1) is the one gone: if it was the batch's lowest, the entry moves up.
local function leave_batch(K, key, g, m, k, c)
  if redis.call('HINCRBY', K.checkouts, key, -k) <= 0 then
    redis.call('HDEL', K.checkouts, key)
    redis.call('ZREM', K.deadlines, key)
    redis.call('ZREM', K.owned, g .. SEP .. m .. SEP .. key)
    redis.call('ZREM', K.held, key)
  elseif c and tonumber(redis.call('ZSCORE', K.held, key) or '-1') == c.id then
    batch_low_gone(K, key, c.tag)
  end
end

-- Is this checkout member m's to settle now? Not if it is another's, was
-- taken under an epoch older than the group's (a SEEK since), or is past its
-- deadline — a late ACK, NACK or RENEW settles nothing, even before the
-- sweep returns it. `due` is its deadline (false while it waits unleased in
-- a push mailbox).
local function settles(c, g, m, epoch, due, now)
  return c and c.group == g and c.member == m and c.epoch >= epoch and not (due and tonumber(due) <= now)
end

-- The records of `tags` (false where none), and how many checkouts the
-- queue has. A hash of at most 128 small records is a listpack, where every
-- lookup is a scan: one that holds at most twice the batch is read whole in
-- one pass instead (O(batch) either way).
local function checkout_records(K, tags)
  local size = redis.call('HLEN', K.checkouts)
  if size > 2 * #tags then return redis.call('HMGET', K.checkouts, unpack(tags)), size end
  local by_tag, out = {}, {}
  if size > 0 then
    local all = redis.call('HGETALL', K.checkouts)
    for i = 1, #all, 2 do by_tag[all[i]] = all[i + 1] end
  end
  for i, tag in ipairs(tags) do out[i] = by_tag[tag] or false end
  return out, size
end

-- Remove settled checkouts of member m of group g: `tags`; `singles` (those
-- with a lease of their own) and `batches` (key -> how many of `tags` it
-- holds, `order` its keys in the order met). `size` is K.checkouts' length
-- before. When they and their batches' counts are all the hash has, the four
-- keys go whole (a listpack deletes field by field, each a scan).
local function remove_checkouts(K, g, m, tags, ids, singles, batches, order, size)
  add_total(K, OUT, -#tags)
  local emptied, left = {}, {}
  if #order > 0 then
    local counts = redis.call('HMGET', K.checkouts, unpack(order))
    for i, key in ipairs(order) do
      if tonumber(counts[i] or '0') <= batches[key] then emptied[#emptied + 1] = key else left[#left + 1] = key end
    end
  end
  if size == #tags + #emptied then
    redis.call('DEL', K.checkouts, K.deadlines, K.owned, K.held)
    return
  end
  local gm = g .. SEP .. m .. SEP
  local fields, leases, owned = {}, {}, {}
  for i, tag in ipairs(tags) do fields[i] = tag end
  for _, tag in ipairs(singles) do
    leases[#leases + 1] = tag
    owned[#owned + 1] = gm .. tag
  end
  for _, key in ipairs(emptied) do
    fields[#fields + 1] = key
    leases[#leases + 1] = key
    owned[#owned + 1] = gm .. key
  end
  for _, key in ipairs(left) do redis.call('HINCRBY', K.checkouts, key, -batches[key]) end
  redis.call('HDEL', K.checkouts, unpack(fields))
  if #leases > 0 then
    redis.call('ZREM', K.deadlines, unpack(leases))
    redis.call('ZREM', K.owned, unpack(owned))
  end
  -- Holding entries: a single checkout's goes by its tag, and so does each of a batch that has one per
  -- checkout (a priority queue's, or one an older worker made); a batch's own goes with the batch, or
  -- moves up when its lowest was settled here (a group holds an id once: that tag is the batch's).
  local per_tag, lows = #singles > 0, {}
  if #order > 0 then
    local scores, tag_of, still = redis.call('ZMSCORE', K.held, unpack(order)), nil, {}
    for _, key in ipairs(left) do still[key] = true end
    for i, key in ipairs(order) do
      if not scores[i] then per_tag = true
      elseif still[key] then
        if not tag_of then
          tag_of = {}
          for j, id in ipairs(ids) do tag_of[id] = tags[j] end
        end
        local gone = tag_of[tonumber(scores[i])]
        if gone then lows[#lows + 1] = {key, gone} end
      end
    end
  end
  if per_tag then redis.call('ZREM', K.held, unpack(tags)) end
  if #emptied > 0 then redis.call('ZREM', K.held, unpack(emptied)) end
  for _, low in ipairs(lows) do batch_low_gone(K, low[1], low[2]) end
end

-- Remove a checkout (record, deadline, ownership). Returns it, or nil if the
-- tag is not checked out any more (settled, expired, or never existed).
local function take_checkout(K, tag)
  local rec = redis.call('HGET', K.checkouts, tag)
  if not rec then return nil end
  local c = parse_checkout(tag, rec)
  if not c then return nil end
  redis.call('HDEL', K.checkouts, tag)
  if c.batch then leave_batch(K, c.batch, c.group, c.member, 1, c)
  else
    redis.call('ZREM', K.deadlines, tag)
    redis.call('ZREM', K.owned, c.group .. SEP .. c.member .. SEP .. tag)
  end
  redis.call('ZREM', K.held, tag)  -- (a batch's checkout has an entry of its own if an older worker made it)
  add_total(K, OUT, -1)
  return c
end

-- Give checkout c (of a batch) a lease of its own, due at `due` (false: none
-- yet, as a mailbox entry waits): its record drops its place in the batch,
-- which counts it off.
local function lease_alone(K, c, due)
  leave_batch(K, c.batch, c.group, c.member, 1, c)
  c.batch = nil
  redis.call('HSET', K.checkouts, c.tag, c.group .. SEP .. c.member .. SEP .. int_str(c.id) .. SEP .. int_str(c.epoch)
    .. SEP .. int_str(c.acq) .. SEP .. int_str(c.fail))
  if due then redis.call('ZADD', K.deadlines, due, c.tag) end
  redis.call('ZADD', K.owned, 0, c.group .. SEP .. c.member .. SEP .. c.tag)
  redis.call('ZADD', K.held, int_str(c.id), c.tag)
end

-- The tags of the checkouts under the leases `leases` (tags, or batch keys,
-- as K.deadlines and K.owned hold them): a batch's are its records in its
-- range that still name it. O(the batches' spans).
local function tags_of_leases(K, leases)
  local tags = {}
  for _, lease in ipairs(leases) do
    local first, span = string.match(lease, '^b(%d+)%+(%d+)$')
    if not span then tags[#tags + 1] = lease
    else
      first, span = tonumber(first), tonumber(span)
      local range = int_strs(first, span + 1)
      local recs = redis.call('HMGET', K.checkouts, unpack(range))
      for i, rec in ipairs(recs) do
        if rec then
          local tail = string.match(rec, '^[^%z]*%z[^%z]*%z%d+%z%d+%z%d+%z%d+(.*)$')
          if tail and batch_of(tail) == lease then tags[#tags + 1] = range[i] end
        end
      end
    end
  end
  return tags
end

-- Is message `id` checked out, by any group? Only the holding entries at or
-- below `id` can hold it: a tag's (its score is its id), a batch's (looked up
-- in its records). Asked only of the rare message below the log's head
-- (lib/retention.lua, forget_below_first). O(those leases' spans).
local function is_checked_out(K, id)
  local leases = redis.call('ZRANGEBYSCORE', K.held, '-inf', id, 'WITHSCORES')
  local function reached(c) return c.id >= id end  -- a batch with an entry of its own: its ids rise with its tags
  for i = 1, #leases, 2 do
    local lease = leases[i]
    if string.sub(lease, 1, 1) ~= 'b' then
      if tonumber(leases[i + 1]) == id then return true end
    else
      local c = scan_batch(K, lease, nil, reached)
      if c and c.id == id then return true end
    end
  end
  return false
end
