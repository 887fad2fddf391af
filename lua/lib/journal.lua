-- lib/journal.lua: the journal, compact events appended to a capped per-queue
-- list in the queue's own slot (snapshots carry it to the analytics).
-- Buffered during a call and written by flush_journal with one RPUSH and one
-- LTRIM. The cap lives in the meta hash (`jcap`, set by publish and subscribe
-- from the config); 0 turns the journal off, and then the hot fences build no
-- journal string at all (they ask journal_on first).
--@include lib/base.lua
--
-- Entry: ms TAB event TAB group TAB member TAB id TAB tag TAB epoch TAB extra
-- A batch entry (journal_batch: the messages of one call that share the time,
-- event, group, member and epoch) has the same fields, with the ids and tags
-- as runs and the extras as repeats: `ids` = `5-104,107` (5, 6, …, 104, 107),
-- `tags` = `q7-9,10` (q7, q8, q9, 10: a run keeps its prefix), `extra` =
-- `1*99,2` (99 times 1, then 2). A batch of one is an ordinary entry.
local JOURNAL, JOURNAL_N, JOURNAL_CAP = {}, 0, nil

-- A field as text: integers written whole (never 1e+14), absent ones empty.
local function journal_field(v)
  if v == nil then return '' end
  if type(v) == 'number' then return int_str(v) end
  return v
end

-- Is the journal on for this queue? Read once per call. `cap` (optional) is
-- the cap this call is about to write (publish and subscribe set it).
local function journal_on(K, cap)
  if cap then JOURNAL_CAP = tonumber(cap) end
  if JOURNAL_CAP == nil then JOURNAL_CAP = tonumber(redis.call('HGET', K.meta, 'jcap') or '0') end
  return JOURNAL_CAP > 0
end

local function journal(ms, ev, g, m, id, tag, ep, extra)
  if JOURNAL_CAP == 0 then return end  -- known to be off in this call
  JOURNAL_N = JOURNAL_N + 1
  JOURNAL[JOURNAL_N] = int_str(ms) .. '\t' .. ev .. '\t' .. (g or '') .. '\t' .. (m or '') .. '\t'
    .. journal_field(id) .. '\t' .. journal_field(tag) .. '\t' .. journal_field(ep) .. '\t' .. journal_field(extra)
end

-- Integers as runs of consecutive values, each run formatted once: `a-b` or
-- `a`, joined by commas. `marks` (optional) holds a prefix per value ('q'
-- for a QoS 0 tag); a run never spans two prefixes.
local function journal_runs(nums, marks)
  local out, n, i, last = {}, 0, 1, #nums
  while i <= last do
    local j, mark = i, marks and marks[i] or ''
    while j < last and nums[j + 1] == nums[j] + 1 and (not marks or marks[j + 1] == mark) do j = j + 1 end
    n = n + 1
    if j > i then out[n] = mark .. int_str(nums[i]) .. '-' .. int_str(nums[j])
    else out[n] = mark .. int_str(nums[i]) end
    i = j + 1
  end
  return table.concat(out, ',')
end

-- The same, for integers given as text (ids read from records, tags from a
-- client): a batch whose values are as long as each other, ascend, and span
-- exactly their count is one run, read from two numbers rather than all.
local function journal_text_runs(texts)
  local n = #texts
  local first, last, ascending = texts[1], texts[n], true
  for i = 2, n do
    if #texts[i] ~= #first or texts[i] <= texts[i - 1] then ascending = false; break end
  end
  if ascending and tonumber(last) - tonumber(first) == n - 1 then
    return n == 1 and first or (first .. '-' .. last)
  end
  local nums = {}
  for i = 1, n do nums[i] = tonumber(texts[i]) end
  return journal_runs(nums)
end

-- Values as repeats: `v*k` for k equal values in a row, `v` for one.
local function journal_repeats(values)
  local out, n, i, last = {}, 0, 1, #values
  while i <= last do
    local j = i
    while j < last and values[j + 1] == values[i] do j = j + 1 end
    n = n + 1
    out[n] = journal_field(values[i]) .. (j > i and ('*' .. int_str(j - i + 1)) or '')
    i = j + 1
  end
  return table.concat(out, ',')
end

-- One entry for the messages of one call (ids: numbers; tags: numbers with
-- tag_marks, or nil; extras: one per message, or nil). The caller checks
-- journal_on first, so nothing is built when the journal is off. With
-- `as_text`, ids and tags are decimal text (no marks).
-- A batch entry whose runs and repeats the caller wrote itself (ids_text,
-- tags_text, extra_text: as journal_runs and journal_repeats write them).
local function journal_batch_text(ms, ev, g, m, ids_text, tags_text, ep, extra_text)
  JOURNAL_N = JOURNAL_N + 1
  JOURNAL[JOURNAL_N] = int_str(ms) .. '\t' .. ev .. '\t' .. (g or '') .. '\t' .. (m or '') .. '\t'
    .. ids_text .. '\t' .. (tags_text or '') .. '\t' .. journal_field(ep) .. '\t' .. (extra_text or '')
end

local function journal_batch(ms, ev, g, m, ids, tags, tag_marks, ep, extras, as_text)
  if #ids == 0 then return end
  local runs = as_text and journal_text_runs or journal_runs
  journal_batch_text(ms, ev, g, m, runs(ids), tags and runs(tags, tag_marks), ep, extras and journal_repeats(extras))
end

local function flush_journal(K)
  if JOURNAL_N == 0 then return end
  if journal_on(K) then
    for i = 1, JOURNAL_N, 1000 do
      redis.call('RPUSH', K.journal, unpack(JOURNAL, i, math.min(i + 999, JOURNAL_N)))
    end
    redis.call('LTRIM', K.journal, -JOURNAL_CAP, -1)
  end
  JOURNAL, JOURNAL_N = {}, 0
end
