-- lib/journal.lua: the journal, compact events appended to a capped per-queue
-- list in the queue's own slot (snapshots carry it to the analytics).
-- Buffered during a call and written by flush_journal with one RPUSH and one
-- LTRIM. The cap lives in the meta hash (`jcap`, set by publish and subscribe
-- from the config); 0 turns the journal off.
--@include lib/base.lua
--
-- Entry: ms TAB event TAB group TAB member TAB id TAB tag TAB epoch TAB extra
local JOURNAL, JOURNAL_N = {}, 0
-- A field as text: integers written whole (never 1e+14), absent ones empty.
local function journal_field(v)
  if v == nil then return '' end
  if type(v) == 'number' then return int_str(v) end
  return v
end

local function journal(ms, ev, g, m, id, tag, ep, extra)
  JOURNAL_N = JOURNAL_N + 1
  JOURNAL[JOURNAL_N] = int_str(ms) .. '\t' .. ev .. '\t' .. (g or '') .. '\t' .. (m or '') .. '\t'
    .. journal_field(id) .. '\t' .. journal_field(tag) .. '\t' .. journal_field(ep) .. '\t' .. journal_field(extra)
end

local function flush_journal(K)
  if JOURNAL_N == 0 then return end
  local cap = tonumber(redis.call('HGET', K.meta, 'jcap') or '0')
  if cap > 0 then
    for i = 1, #JOURNAL, 1000 do
      redis.call('RPUSH', K.journal, unpack(JOURNAL, i, math.min(i + 999, #JOURNAL)))
    end
    redis.call('LTRIM', K.journal, -cap, -1)
  end
  JOURNAL, JOURNAL_N = {}, 0
end
