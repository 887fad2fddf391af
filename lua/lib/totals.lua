-- lib/totals.lua: the broker's totals, kept by the fences as they write
-- (docs/ui.md, "Totals"). Every write that changes what a figure counts adds
-- the change, in the same call, to K.totals (hash) and, for the backlog, to
-- K.backlogs (zset: entry -> messages ready), so a total is a read, never a
-- scan, and exact after any sequence of calls. On a Cluster both keys are
-- per slot (the queue's), elsewhere one each (broker/fences/registry.py).
-- An *entry* is what the overview lists: a plain topic's or a filter
-- subscription's queue (its id), or a lite topic with all its lmqs
-- ('l:<topic>'). Figures held (moved by add_total):
--   ready     messages a group may read now: past its cursor, or returned
--   out       checkouts (QoS 1 deliveries not yet settled, mailbox entries)
--   delayed   NACKed with a DELAY, not yet due
--   dead      dead letters
--   scheduled published for later (PUB … DELAY/AT), not yet due
-- broker-wide, and per entry (ready in K.backlogs; the others as
-- '<figure>|<entry>' fields, deleted at 0). Events (tally, broker-wide):
-- published (and 'published|<entry>'), delivered, redelivered, acked,
-- nacked, dead_lettered, timeouts, expired (and 'expired|<entry>': messages a
-- group met expired and settled unsent, lib/expiry.lua). Queues: 'queues:t', 'queues:l',
-- 'queues:f' (an lmq set to be reclaimed is not counted), 'lmqs|<entry>',
-- 'consumers' (members of every group), and of them 'suspected' and
-- 'fenced' (carrying an eviction marker). And 'srv', which is no figure: the
-- server that has held the slot's state from its first queue (lib/ids.lua,
-- ids_from_one).
--@include lib/base.lua
--@include lib/ids.lua

local READY, OUT, DELAYED, DEAD, SCHEDULED = 'ready', 'out', 'delayed', 'dead', 'scheduled'
local ENTRIES = {}  -- meta key -> entry, per call

-- The entry a queue counts under, from its meta key '<prefix>:{<queue id>}'
-- (read, not built: the key came in KEYS).
local function queue_entry(K)
  local e = ENTRIES[K.meta]
  if e then return e end
  e = string.match(K.meta, '{([^}]*)}$') or ''
  if string.sub(e, 1, 2) == 'l:' then e = string.match(e, '^(l:[^:]*):') or e end
  ENTRIES[K.meta] = e
  return e
end

-- A figure held moved by n (an integer; nothing when 0).
local function add_total(K, what, n)
  if n == 0 then return end
  local e = queue_entry(K)
  redis.call('HINCRBY', K.totals, what, n)
  if what == READY then
    if tonumber(redis.call('ZINCRBY', K.backlogs, n, e)) == 0 then redis.call('ZREM', K.backlogs, e) end
  elseif redis.call('HINCRBY', K.totals, what .. '|' .. e, n) == 0 then
    redis.call('HDEL', K.totals, what .. '|' .. e)
  end
end

-- A broker-wide figure moved by n: an event happened n times, or members
-- became (n > 0) or stopped being (n < 0) suspected or fenced off.
local function tally(K, what, n)
  if n ~= 0 then redis.call('HINCRBY', K.totals, what, n) end
end

-- Members joined (n > 0) or left a group of the queue.
local function count_consumers(K, n)
  redis.call('HINCRBY', K.totals, 'consumers', n)
end

-- A member's suspicion and marker are about to be deleted: they leave the counts.
local function uncount_member(K, g, m)
  local f = redis.call('HMGET', K.meta, mf(g, m, SUSPECTED), mf(g, m, MARKER))
  if f[1] then tally(K, 'suspected', -1) end
  if f[2] then tally(K, 'fenced', -1) end
end

-- The queue came to be (n = 1: created, or revived before its reclaim) or
-- went (-1: deleted, or set to be reclaimed).
local function count_queue(K, n)
  local e = queue_entry(K)
  local kind = string.sub(e, 1, 1)
  redis.call('HINCRBY', K.totals, 'queues:' .. kind, n)
  if kind == 'l' and redis.call('HINCRBY', K.totals, 'lmqs|' .. e, n) == 0 then
    redis.call('HDEL', K.totals, 'lmqs|' .. e)
  end
end

-- How many messages a group has past its cursor: the positions from
-- max(cursor, first) to seq that are in no gap (lib/ids.lua).
local function unread_of(meta, cur, first, seq)
  if cur < first then cur = first end
  return count_between(meta, cur, seq)
end

-- Every group's cursor (first when it has none): {group = cursor}.
local function group_cursors(meta, first)
  local groups = redis.call('HGET', meta, 'groups')
  local out = {}
  for _, g in ipairs(groups and split(groups, '\n') or {}) do
    out[g] = tonumber(redis.call('HGET', meta, gf(g, CURSOR)) or first)
  end
  return out
end

-- The log's head moved from `before` to `after` (retention): what each group
-- had unread below `after` is gone from its backlog.
local function count_trimmed(K, before, after)
  if after <= before then return end
  local gone = 0
  for _, cur in pairs(group_cursors(K.meta, before)) do
    local lo = cur < before and before or cur
    gone = gone + count_between(K.meta, lo, after - 1)
  end
  add_total(K, READY, -gone)
end

-- n messages appended to the log (a publish, a scheduled message released):
-- published, and ready for every group the queue has.
local function count_appended(K, n)
  tally(K, 'published', n)
  redis.call('HINCRBY', K.totals, 'published|' .. queue_entry(K), n)
  local groups = redis.call('HGET', K.meta, 'groups')
  if groups then add_total(K, READY, n * #split(groups, '\n')) end
end

-- A queue deleted whole (drop_if_empty): its figures leave the totals. The
-- entry of a filter subscription's queue is the queue alone.
local function count_dropped(K)
  local e = queue_entry(K)
  local ready = tonumber(redis.call('ZSCORE', K.backlogs, e) or '0')
  add_total(K, READY, -ready)
  for _, what in ipairs({OUT, DELAYED, DEAD, SCHEDULED}) do
    add_total(K, what, -tonumber(redis.call('HGET', K.totals, what .. '|' .. e) or '0'))
  end
  redis.call('HDEL', K.totals, 'published|' .. e, 'expired|' .. e)
  count_queue(K, -1)
end
