-- snapshot.lua: one queue's whole state, read in one atomic call (read-only).
--@include lib/seek.lua
--@flags no-writes
--
-- KEYS[1] meta
-- KEYS[2] log
-- KEYS[3] checkouts
-- KEYS[4] deadlines
-- KEYS[5] owned
-- KEYS[6] ready
-- KEYS[7] delayed
-- KEYS[8] dead
-- KEYS[9] journal
-- KEYS[10] scheduled     messages published for later (lib/schedule.lua): counted
-- KEYS[11] priority      a priority queue's index of levels (lib/priority.lua): counted per level
-- KEYS[12] rest           the slot's rest hash: an lmq at rest keeps its meta there (lib/meta.lua)
-- KEYS[13..] mailboxes    push mailboxes (`<meta>:mb:<group>:<member>`), any number:
--   the caller names those of the members that have a `cap` field (it learns
--   them from an earlier snapshot of the queue) and checks them against this
--   call's meta; see broker/ops/snapshot.py
-- ARGV[1] max_log         log entries to list, oldest first (0 = none): ids,
--   publish ms and stored size only, never the bodies
-- ARGV[2] max_journal     entries, the newest (0 = none, -1 = all)
-- ARGV[3] digest          the queue's state digest in the snapshot an
--   incremental one builds on ('' = none): when the state still has it, only
--   {now ms, 'unchanged', digest} is returned (`fencemq snapshot --since`)
-- Errors: BADARG when a limit is not an integer.
-- Returns: (nothing is written)
--   { now ms (Redis TIME),
--     meta (HGETALL, flat),
--     checkouts (HGETALL, flat: tag, record),
--     deadlines (ZRANGE WITHSCORES, flat: tag, deadline ms),
--     ready members,
--     delayed (ZRANGE WITHSCORES, flat: member, due ms),
--     {log entries retained (HLEN), owned entries (ZCARD), dead letters (LLEN),
--      journal entries kept (LLEN), scheduled messages (ZCARD)},
--     mailbox depths (LLEN, one per mailbox key, the EOS sentinel included),
--     oldest pending message per group (flat: group, id, publish ms): the
--       smallest retained id (>= first) the group has not settled — checked
--       out, returned, delayed, or not yet read (cursor ≤ seq); groups with
--       nothing pending are left out,
--     log entries (flat: id, publish ms, stored body bytes),
--     journal entries (oldest first, format in _common.lua `journal`),
--     digest (SHA-1 hex of everything above but the time, the log entries
--     listed and the journal: of the journal, its length and newest entry),
--     levels: {} unless the queue honours priority (meta prio = 1); then the
--       messages held in its index at each level 0..9 (ten counts), then, for each
--       group in meta's order, its unread at each level 0..9 (lib/priority.lua
--       level_cursors, level_count: the rule the ready total counts by) }
--   or, when the digest passed is this one, {now ms, 'unchanged', digest}.
--   An empty meta (the queue vanished after the SCAN that found it) returns
--   the same shape with empty parts.
-- Consistent: every part is read in this one call, so every invariant of the
-- queue holds between them (e.g. each checkout has its deadline or is in a
-- mailbox, each group's cursor and epoch agree with its checkouts).
-- Cost: O(state of the queue + log entries + journal entries listed); one
--   HGET of the log per group (the oldest pending message); a priority queue's
--   levels: 10 · (groups + 1) ZCOUNTs.
local max_log = int_arg(A.max_log, 'max log entries')
local max_journal = int_arg(A.max_journal, 'max journal entries', -1)
local now = now_ms()

-- meta as if expanded: a snapshot never shows the compact form of an lmq at rest
local meta, f = {}, {}
local rested = rested_meta(K)  -- an lmq at rest, read where it rests: this fence writes nothing
local stored = rested or redis.call('HGETALL', K.meta)
local omitted = rested and omitted_in(rested) or omitted_fields(K.meta)
local compact_only = {}
if omitted then
  compact_only.z = true
  for _, name in ipairs(SHORT_NAMES) do compact_only[name] = true end
end
for _, list in ipairs({stored, omitted or {}}) do
  for i = 1, #list, 2 do
    if not compact_only[list[i]] then
      meta[#meta + 1] = list[i]
      meta[#meta + 1] = list[i + 1]
      f[list[i]] = list[i + 1]
    end
  end
end
local co = redis.call('HGETALL', K.checkouts)
local dl = redis.call('ZRANGE', K.deadlines, 0, -1, 'WITHSCORES')
local rd = redis.call('ZRANGE', K.ready, 0, -1)
local dly = redis.call('ZRANGE', K.delayed, 0, -1, 'WITHSCORES')
local counts = {redis.call('HLEN', K.log), redis.call('ZCARD', K.owned), redis.call('LLEN', K.dead),
                redis.call('LLEN', K.journal), redis.call('ZCARD', K.scheduled)}
local mailboxes = {}
for _, box in ipairs(K.mailboxes) do mailboxes[#mailboxes + 1] = redis.call('LLEN', box) end
-- Every write of a fence changes one of these (a state seen before hashes the
-- same; the same state read in another hash order only costs a full read).
local digest = redis.sha1hex(cmsgpack.pack({stored, co, dl, rd, dly, counts, mailboxes,
                                            redis.call('LINDEX', K.journal, -1) or ''}))
if A.digest ~= '' and A.digest == digest then return {now, 'unchanged', digest} end

local seq, first = tonumber(f.seq or '0'), tonumber(f.first or '1')
local low = {}
local function pending(g, id)
  if id and id >= first and id <= seq and (low[g] == nil or id < low[g]) then low[g] = id end
end
for i = 2, #co, 2 do
  local p = split(co[i], SEP)
  pending(p[1], tonumber(p[3]))
end
for _, member in ipairs(rd) do
  local p = split(member, SEP)
  pending(p[1], tonumber(p[2]))
end
for i = 1, #dly, 2 do
  local p = split(dly[i], SEP)
  pending(p[1], tonumber(p[2]))
end
local oldest = {}
for _, g in ipairs(f.groups and split(f.groups, '\n') or {}) do
  local cur = tonumber(f[gf(g, CURSOR)] or first)
  if cur < first then cur = first end
  pending(g, past_gap(K.meta, cur))  -- a cursor in a gap reads next from the id after it (lib/ids.lua)
  if low[g] then
    local body = redis.call('HGET', K.log, low[g])
    if body then
      oldest[#oldest + 1] = g
      oldest[#oldest + 1] = low[g]
      oldest[#oldest + 1] = published_at(body)
    end
  end
end

local entries = {}
if max_log > 0 then
  -- the first max_log positions from the head, gaps stepped over (lib/ids.lua)
  local id, left = past_gap(K.meta, first), max_log
  while left > 0 and id <= seq do
    local last = run_end(K.meta, id, math.min(seq, id + left - 1))
    for at = id, last do
      local body = redis.call('HGET', K.log, at)
      if body then
        local ms = string.match(body, '^(%d+):')
        entries[#entries + 1] = at
        entries[#entries + 1] = tonumber(ms)
        entries[#entries + 1] = #body - #ms - 1
      end
    end
    left = left - (last - id + 1)
    id = past_gap(K.meta, last + 1)
  end
end

local jr = {}
if max_journal < 0 then jr = redis.call('LRANGE', K.journal, 0, -1)
elseif max_journal > 0 then jr = redis.call('LRANGE', K.journal, -max_journal, -1) end

-- A priority queue's levels (its index and level cursors are covered by the digest: every change to
-- them comes with one to the log's length or meta)
local levels = {}
if f.prio == '1' then
  for p = 0, LEVELS - 1 do levels[#levels + 1] = level_count(K, p, 0) end
  for _, g in ipairs(f.groups and split(f.groups, '\n') or {}) do
    local cur = tonumber(f[gf(g, CURSOR)] or first)
    if cur < first then cur = first end
    local c = level_cursors(K, g, cur)
    for p = 0, LEVELS - 1 do levels[#levels + 1] = level_count(K, p, math.max(c[p], first)) end
  end
end

return {now, meta, co, dl, rd, dly, counts, mailboxes, oldest, entries, jr, digest, levels}
