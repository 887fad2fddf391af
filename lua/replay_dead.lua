-- replay_dead.lua: an operator puts dead letters back into their group's queue.
--@include lib/lite.lua
--@flags none
--
-- Errors: BADARG on a bad count.
-- Cost: O(examined + position of the last replayed dead letter).
--
-- KEYS[1] meta
-- KEYS[2] log
-- KEYS[3] checkouts
-- KEYS[4] ready
-- KEYS[5] delayed
-- KEYS[6] dead
-- KEYS[7] dedup
-- KEYS[8] dedup_ids
-- KEYS[9] wake
-- KEYS[10] journal
-- KEYS[11] totals         the broker's totals (lib/totals.lua)
-- KEYS[12] backlogs
-- KEYS[13] priority       a priority queue's index of levels (lib/priority.lua)
-- KEYS[14] rest           the slot's rest hash: an lmq at rest keeps its meta there (lib/meta.lua)
-- ARGV[1] count           replay at most this many
-- ARGV[2] scan_limit      examine at most this many dead letters, from the head (the oldest)
-- ARGV[3] idle_ttl_ms     of an lmq (0 = a plain topic)
-- Returns: {replayed, skipped, dead letters left, examined}
--   replayed: flat {id, group, member, acquisitions, via} per message, in
--     dead-letter order; via = 'ready' (put in the group's ready set) or
--     'cursor' (the group's cursor is at or before the id since a seek: it
--     reads the message again from the log, nothing to add)
--   skipped: flat {position, id, group, reason} per dead letter left where
--     it was; reason = 'no-group' (the group is gone), 'trimmed' (its
--     message is gone from the log and the dead letter carries no copy of
--     it: one written before dead letters did) or 'undecodable' (id and
--     group are then '').
-- A dead letter carries its message: one whose message the log no longer
-- holds (every group had settled it, or retention trimmed it) puts it back
-- under its id, where its group reads it again; once settled, it goes
-- (lib/retention.lua, forget_below_first).
-- A replayed dead letter is removed from the list and its message goes back
-- to its group's ready set as `group NUL id(16 digits) NUL acquisitions NUL 0`
-- (see ready_member in _common.lua): read before new messages, in id order,
-- with its failures reset to 0 (max_failures more NACKs before it is dead
-- again) and its acquisitions kept (the next delivery counts one more). A
-- message already in the ready set of its group is not added twice. One
-- 'replay' journal event each (extra = acquisitions). Skipped dead letters
-- keep their place; the walk goes past them, so they never block a replay.
wake_from_rest(K)  -- an lmq at rest gets its meta key back first (lib/meta.lua)
expand_meta(K.meta)  -- this fence writes meta: no field may be left to a default
local count = int_arg(A.count, 'count')
local limit = int_arg(A.scan_limit, 'scan limit')
local ttl = int_arg(A.idle_ttl_ms, 'idle TTL')
if count < 1 then raise('BADARG', 'count must be at least 1') end
if limit < count then limit = count end

local TOMBSTONE = '\0replayed\0'
local now = now_ms()
local replayed, skipped, gone = {}, {}, {}
local examined, prefix = 0, true
local pos = 0
while #gone < count and examined < limit do
  local chunk = redis.call('LRANGE', K.dead, pos, pos + math.min(100, limit - examined) - 1)
  if #chunk == 0 then break end
  for i, raw in ipairs(chunk) do
    if #gone >= count or examined >= limit then break end
    local at = pos + i - 1
    examined = examined + 1
    -- nack.lua packs one array {id, group, member, acquisitions, failures, ms, body}.
    local ok, entry = pcall(cmsgpack.unpack, raw)
    local id, g, m, acq
    if ok and type(entry) == 'table' then id, g, m, acq = entry[1], entry[2], entry[3], entry[4] end
    if not ok or type(id) ~= 'number' or type(g) ~= 'string' then
      skipped[#skipped + 1] = at; skipped[#skipped + 1] = ''; skipped[#skipped + 1] = ''
      skipped[#skipped + 1] = 'undecodable'
      prefix = false
    else
      local gs = redis.call('HMGET', K.meta, gf(g, MODE), gf(g, CURSOR), 'first')
      local reason
      local body = entry[7]
      if not gs[1] then reason = 'no-group'
      elseif redis.call('HEXISTS', K.log, id) == 0 then
        if type(body) == 'string' then redis.call('HSET', K.log, id, body) else reason = 'trimmed' end
      end
      if reason then
        skipped[#skipped + 1] = at; skipped[#skipped + 1] = id; skipped[#skipped + 1] = g
        skipped[#skipped + 1] = reason
        prefix = false
      else
        local cur = math.max(tonumber(gs[2] or gs[3] or '1'), tonumber(gs[3] or '1'))
        local via = 'ready'
        local reads = id >= cur
        if reads and prio_on(K) then reads = cursor_reads(K, g, id, cur) end  -- by its level's cursor
        if reads then
          via = 'cursor'
        else
          local member = ready_member(g, id, acq, 0)
          local queued = redis.call('ZRANGEBYLEX', K.ready, '[' .. g .. SEP .. pad(id) .. SEP,
                                    '(' .. g .. SEP .. pad(id) .. '\1', 'LIMIT', 0, 1)
          if #queued == 0 then add_total(K, READY, redis.call('ZADD', K.ready, 0, member)) end
        end
        journal(now, 'replay', g, m, id, nil, nil, acq)
        replayed[#replayed + 1] = id; replayed[#replayed + 1] = g; replayed[#replayed + 1] = m or ''
        replayed[#replayed + 1] = acq or 0; replayed[#replayed + 1] = via
        gone[#gone + 1] = at
      end
    end
  end
  pos = pos + #chunk
end

if #gone > 0 then
  add_total(K, DEAD, -#gone)
  if prefix then
    -- The replayed dead letters are the head of the list: drop them in one go.
    redis.call('LTRIM', K.dead, #gone, -1)
  else
    -- Mark them, then remove exactly that many marks (LREM stops at the last one).
    for _, at in ipairs(gone) do redis.call('LSET', K.dead, at, TOMBSTONE) end
    redis.call('LREM', K.dead, #gone, TOMBSTONE)
  end
  reclaim_if_idle(K, ttl)
  redis.call('SPUBLISH', K.wake, 'replay')
end
flush_journal(K)
put_to_rest(K)
return {replayed, skipped, redis.call('LLEN', K.dead), examined}
