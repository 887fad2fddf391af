-- lib/ids.lua: an id is never given to two messages, failover included
-- (docs/data-model.md, "Message ids"). A queue gives ids counting up from its
-- `seq`. A replica promoted while it lagged, or a server restarted from a
-- persistence file that missed its last writes, holds an older `seq` than the
-- server that gave the last ids: counting on from it would give those ids
-- again. So the meta hash names, in `srv`, the server that gave its ids (the
-- first 8 hex digits of its run_id: another after a promotion or a restart),
-- and the first fence that gives ids on a queue last written by another
-- server goes on past every id that server may have given (guard_ids). The
-- ids skipped form a *gap*: positions no message holds or ever will, kept in
-- the meta field `gaps` ("a-b,c-d": inclusive, ascending) until the log's
-- head passes them. Whatever counts or walks the positions between a cursor
-- (or the head) and `seq` goes through the helpers below.
--
-- Asking the server its run_id (INFO) costs ~5 µs, so a fence asks only when
-- the queue's ids were last given at least SERVER_CHECK_MS ago (`wt`): a
-- promotion or a restart takes longer than that (Sentinel's
-- down-after-milliseconds and cluster-node-timeout, plus the election), so
-- the first ids given after one always ask. O(gaps) per call: a gap is made
-- only by a promotion or a restart.
--@include lib/base.lua

local SERVER_CHECK_MS = 1000

-- The queue's gaps, {{a, b}, ...} ascending, read once per call.
local GAPS = {}
local function gaps_of(meta)
  local known = GAPS[meta]
  if known then return known end
  local out = {}
  local text = redis.call('HGET', meta, 'gaps')
  if text then
    for _, span in ipairs(split(text, ',')) do
      local dash = string.find(span, '-', 1, true)
      out[#out + 1] = {tonumber(string.sub(span, 1, dash - 1)), tonumber(string.sub(span, dash + 1))}
    end
  end
  GAPS[meta] = out
  return out
end

local function write_gaps(meta, gaps)
  GAPS[meta] = gaps
  if #gaps == 0 then
    redis.call('HDEL', meta, 'gaps')
    return
  end
  local spans = {}
  for i, g in ipairs(gaps) do spans[i] = int_str(g[1]) .. '-' .. int_str(g[2]) end
  redis.call('HSET', meta, 'gaps', table.concat(spans, ','))
end

-- How many positions of [from, to] may hold a message (those in no gap).
local function count_between(meta, from, to)
  if to < from then return 0 end
  local n = to - from + 1
  for _, g in ipairs(gaps_of(meta)) do
    local lo, hi = math.max(g[1], from), math.min(g[2], to)
    if hi >= lo then n = n - (hi - lo + 1) end
  end
  return n
end

-- p, or the first position after the gap p falls in.
local function past_gap(meta, p)
  for _, g in ipairs(gaps_of(meta)) do
    if p >= g[1] and p <= g[2] then p = g[2] + 1 end
  end
  return p
end

-- The last position of the run of positions that starts at p (p in no gap):
-- the one before the next gap, or `limit`, whichever is lower.
local function run_end(meta, p, limit)
  for _, g in ipairs(gaps_of(meta)) do
    if g[1] > p and g[1] - 1 < limit then return g[1] - 1 end
  end
  return limit
end

-- The position k places (k ≥ 0, gaps not counted) after position `from`.
local function position_after(meta, from, k)
  local p = past_gap(meta, from)
  for _, g in ipairs(gaps_of(meta)) do
    if g[1] > p then
      if p + k < g[1] then return p + k end
      k = k - (g[1] - p)
      p = g[2] + 1
    end
  end
  return p + k
end

-- Gaps wholly below the log's head: nothing reads there any more.
local function forget_gaps_below(meta, first)
  local gaps, kept = gaps_of(meta), {}
  for _, g in ipairs(gaps) do
    if g[2] >= first then kept[#kept + 1] = g end
  end
  if #kept < #gaps then write_gaps(meta, kept) end
end

local function server_id()
  return string.sub(string.match(redis.call('INFO', 'server'), 'run_id:(%x+)'), 1, 8)
end

-- May a new plain topic start its ids at 1? Only on the server that has held
-- the slot's state from its first queue on: the totals hash of the slot (one
-- per slot on a Cluster, one in all elsewhere, lib/totals.lua) names it in
-- `srv`, set by the slot's first new queue, to this server when it has never
-- been a replica promoted (INFO replication: no second replication id), else
-- to '-', which is no server. On any other server the topic may be one that a
-- failover or a restart lost whole, its ids given already: it starts at the
-- clock, and the slot's `srv` becomes '-' for good (its first server, back as
-- primary after a failover and a failback, may have lost topics too). Asked
-- once per new queue (and the server's history once per slot).
local function ids_from_one(totals, here)
  local holder = redis.call('HGET', totals, 'srv')
  if not holder then
    local replication = redis.call('INFO', 'replication')
    local second = string.match(replication, 'master_replid2:(%x+)') or ''
    holder = string.find(second, '[^0]') and '-' or here
    redis.call('HSET', totals, 'srv', holder)
  elseif holder ~= here and holder ~= '-' then
    redis.call('HSET', totals, 'srv', '-')
  end
  return holder == here
end

-- Before a fence gives ids after `seq` (a queue that has given ids before,
-- last at `wt`, by server `srv`): the seq to count on from. The same seq,
-- unless another server gave the queue's last ids. Then that server may have
-- given more after `wt` (what this one never got), at most 1,000 a ms on
-- average (the bound lmqs' clock ids rest on, docs/data-model.md): the ids
-- go on 1,000 per ms since `wt` further, the ids skipped made a gap. (Not
-- `now · 1000`: a priority queue's ids stay below 2^48, lib/priority.lua, so
-- a plain topic's ids grow with the time it failed over after, not with the
-- date.) Records this server as the queue's when it asked.
local function guard_ids(meta, now, seq, wt, srv)
  if wt and now - tonumber(wt) < SERVER_CHECK_MS and srv then return seq end
  local here = server_id()
  if srv == here then
    return seq
  end
  redis.call('HSET', meta, 'srv', here)
  -- a queue from before `srv` was kept (nil): nothing to compare with
  if not srv then return seq end
  local gaps, top = gaps_of(meta), seq + math.max(now - tonumber(wt or now - SERVER_CHECK_MS), 1) * 1000
  local last = gaps[#gaps]
  if last and last[2] == seq then last[2] = top else gaps[#gaps + 1] = {seq + 1, top} end
  write_gaps(meta, gaps)
  redis.call('HSET', meta, 'seq', int_str(top))
  return top
end
