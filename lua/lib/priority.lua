-- lib/priority.lua: priority queues (PUB … PRIORITY p; docs/protocol.md, "Priority").
-- A plain topic's queue set to honour priority (meta `prio` = 1, lua/prioritize.lua)
-- keeps, beside its one id-ordered log, an index of every message it holds:
-- K.priority, a zset of message ids scored (9 - level) · 2^48 + id, so that one
-- score range is one level, levels run from 9 (first) to 0, and ids ascend within
-- a level (FIFO). Each group reads every level from its own cursor (meta
-- `g|<g>|pc`: ten ids, level 0 first; absent: every level's cursor is the group's
-- cursor). The group's cursor `cur` is kept as its low-water mark — the lowest id
-- it has not read at any level (seq + 1 when none) — so what reads a cursor without
-- knowing about levels (retention, a long poll's "anything left", the snapshot's
-- oldest unread) stays right. A group's unread messages are the index entries at
-- or past its level cursors; the `ready` total counts exactly those.
--@include lib/meta.lua
--@include lib/totals.lua

local LEVELS = 10
local LEVEL_SPAN = 281474976710656  -- 2^48: a message id of a priority queue stays below it
local LEVEL_CURSORS = 'pc'

-- Does this queue honour priority? Read once per call. A fence that may meet a
-- priority queue declares K.priority; one that meets the flag without it fails
-- rather than read the log in id order.
local PRIORITY_ON = {}
local function prio_on(K)
  local known = PRIORITY_ON[K.meta]
  if known == nil then
    known = redis.call('HGET', K.meta, 'prio') == '1'
    if known and not K.priority then raise('INTERNAL', 'a priority queue met by a fence without its index') end
    PRIORITY_ON[K.meta] = known
  end
  return known
end

local function level_low(p) return (LEVELS - 1 - p) * LEVEL_SPAN end

-- Index messages first .. last (consecutive ids) at level p.
local function index_messages(K, p, first, last)
  if last < first then return end
  local args, n, low = {}, 0, level_low(p)
  for id = first, last do
    args[n + 1] = int_str(low + id)
    args[n + 2] = int_str(id)
    n = n + 2
    if n >= 2000 then redis.call('ZADD', K.priority, unpack(args)); args, n = {}, 0 end
  end
  if n > 0 then redis.call('ZADD', K.priority, unpack(args)) end
end

-- A group's level cursors (a table indexed 0..9); absent ones are `cur`.
local function level_cursors(K, g, cur)
  local raw = redis.call('HGET', K.meta, gf(g, LEVEL_CURSORS))
  local c, i = {}, 0
  if raw then
    for v in string.gmatch(raw, '%d+') do c[i] = tonumber(v); i = i + 1 end
  end
  for p = 0, LEVELS - 1 do
    if not c[p] then c[p] = cur end
  end
  return c
end

local function set_level_cursors(K, g, c)
  local parts = {}
  for p = 0, LEVELS - 1 do parts[p + 1] = int_str(c[p]) end
  redis.call('HSET', K.meta, gf(g, LEVEL_CURSORS), table.concat(parts, ' '))
end

-- Up to n ids of level p at or past id `from`, in id order.
local function level_ids(K, p, from, n)
  local low = level_low(p)
  return redis.call('ZRANGEBYSCORE', K.priority, int_str(low + from), int_str(low + LEVEL_SPAN - 1), 'LIMIT', 0, n)
end

-- How many messages of level p lie in ids [from, upto] (upto nil: to the end).
local function level_count(K, p, from, upto)
  local low = level_low(p)
  return redis.call('ZCOUNT', K.priority, int_str(low + from), int_str(low + (upto or LEVEL_SPAN - 1)))
end

-- The group's unread messages: index entries at or past its level cursors.
local function unread_by_level(K, g, cur)
  local c, n = level_cursors(K, g, cur), 0
  for p = 0, LEVELS - 1 do n = n + level_count(K, p, c[p]) end
  return n
end

-- The lowest id the group has not read at any level (seq + 1 when none): its cursor.
local function low_water(K, c, seq)
  local low = seq + 1
  for p = 0, LEVELS - 1 do
    local ids = level_ids(K, p, c[p], 1)
    if ids[1] and tonumber(ids[1]) < low then low = tonumber(ids[1]) end
  end
  return low
end

-- take_next's reading of new messages for a priority queue: up to `want` of them,
-- level 9 first, FIFO within a level, from the group's level cursors. Appends to
-- `taken` ({nil, id, 1, body, 0, id text, level}) and `gone` (expired); moves the
-- cursors and the low-water cursor; the ready total loses every entry passed.
-- Cost: O(levels · log n + want + expired met).
local function take_by_level(K, g, want, now, cur, seq, taken, gone, expired)
  local c = level_cursors(K, g, cur)
  local moved = false
  for p = LEVELS - 1, 0, -1 do
    while want > 0 do
      local ids = level_ids(K, p, c[p], want)
      if #ids == 0 then break end
      local bodies = redis.call('HMGET', K.log, unpack(ids))
      for i, text in ipairs(ids) do
        local body, id = bodies[i], tonumber(text)
        if body then
          if expired(body, now) then gone[#gone + 1] = id
          else
            taken[#taken + 1] = {nil, id, 1, body, 0, text, p}
            want = want - 1
          end
        end
      end
      c[p] = tonumber(ids[#ids]) + 1
      add_total(K, READY, -#ids)
      moved = true
    end
  end
  if not moved then return end
  expand_meta(K.meta)
  set_level_cursors(K, g, c)
  redis.call('HSET', K.meta, gf(g, CURSOR), low_water(K, c, seq))
end

-- put_back of new messages of a priority queue: each level's cursor goes back to the
-- lowest id given back at it (what lies between, expired messages met, is unread again).
local function put_back_by_level(K, g, back)
  local f = redis.call('HMGET', K.meta, gf(g, CURSOR), 'seq')
  local cur, seq = tonumber(f[1]), tonumber(f[2] or '0')
  local c = level_cursors(K, g, cur)
  for p, id in pairs(back) do
    if id < c[p] then
      add_total(K, READY, level_count(K, p, id, c[p] - 1))
      c[p] = id
    end
  end
  set_level_cursors(K, g, c)
  redis.call('HSET', K.meta, gf(g, CURSOR), low_water(K, c, seq))
end

-- The log's head moved from `before` to `after` (retention) in a priority queue: each
-- group loses from its backlog what it had unread there, and the index forgets it.
local function trim_levels(K, before, after)
  local groups = redis.call('HGET', K.meta, 'groups')
  local gone = 0
  for _, g in ipairs(groups and split(groups, '\n') or {}) do
    local c = level_cursors(K, g, tonumber(redis.call('HGET', K.meta, gf(g, CURSOR)) or before))
    for p = 0, LEVELS - 1 do
      if c[p] < after then gone = gone + level_count(K, p, c[p], after - 1) end
    end
  end
  add_total(K, READY, -gone)
  for p = 0, LEVELS - 1 do
    local low = level_low(p)
    redis.call('ZREMRANGEBYSCORE', K.priority, int_str(low), int_str(low + after - 1))
  end
end

-- A dead letter replayed (replay_dead.lua): will the group's level cursor still read
-- it? (It is in the index and at or past its level's cursor.)
local function cursor_reads(K, g, id, cur)
  local score = redis.call('ZSCORE', K.priority, id)
  if not score then return false end
  local p = LEVELS - 1 - math.floor(tonumber(score) / LEVEL_SPAN)
  return id >= level_cursors(K, g, cur)[p]
end

-- The level of a schedule id ('s<n>' or 's<n>p<level>': a PRIORITY given at publish).
local function scheduled_level(sid)
  return tonumber(string.match(sid, 'p(%d)$') or '0')
end
