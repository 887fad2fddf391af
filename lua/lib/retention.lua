-- lib/retention.lua: what a queue's log keeps. Without a retention policy a
-- message every group has settled is deleted: the log holds only what some
-- group may still be given (docs/operations.md, "Retention"). A topic with a
-- policy keeps its messages, read or not, until the policy trims them from
-- the oldest: a count, an age, the log's bytes. Either way the log is
-- trimmed from its head only, so it stays whole from `first` to `seq`.
--@include lib/seek.lua

-- The lowest id some group may still be given: each group's cursor, its
-- returned (ready) and delayed messages, and every checkout (K.held, the
-- holding index of all groups' checkouts: lib/leases.lua). nil: keep
-- everything — the queue has no
-- group yet (its messages wait for the first subscriber), a group rewinds
-- to the earliest message when it is preempted (lite ON-PREEMPT earliest),
-- or more delayed messages than one call may look at.
-- Cost: O(groups · log n + delayed messages, at most 1000).
local function lowest_unsettled(K, first, seq)
  local groups = read_meta(K.meta, {'groups'})[1]
  if not groups then return nil end
  local names = {}
  local list = split(groups, '\n')
  for i, g in ipairs(list) do
    names[2 * i - 1] = gf(g, CURSOR)
    names[2 * i] = gf(g, ON_PREEMPT)
  end
  local f = read_meta(K.meta, names)
  local low = seq + 1
  for i, g in ipairs(list) do
    if f[2 * i] == 'earliest' then return nil end
    local cur = tonumber(f[2 * i - 1] or first)
    if cur < low then low = cur end
    local r = redis.call('ZRANGEBYLEX', K.ready, '[' .. g .. SEP, '(' .. g .. '\1', 'LIMIT', 0, 1)
    if r[1] then
      local id = tonumber(split(r[1], SEP)[2])
      if id < low then low = id end
    end
  end
  local held = redis.call('ZRANGE', K.held, 0, 0, 'WITHSCORES')
  if held[2] and tonumber(held[2]) < low then low = tonumber(held[2]) end
  local delayed = redis.call('ZCARD', K.delayed)
  if delayed > 1000 then return nil end
  if delayed > 0 then
    for _, member in ipairs(redis.call('ZRANGE', K.delayed, 0, -1)) do
      local id = tonumber(split(member, SEP)[2])
      if id < low then low = id end
    end
  end
  return low
end

-- Trim the log's head: with `keep` false (no policy), what every group has
-- settled; and, whatever its state, past `maxlen` messages, older than
-- `maxage` ms, or beyond `maxbytes` of the log's memory (Redis's estimate:
-- MEMORY USAGE, sampled). 0 turns a limit off. At most `budget` messages
-- per call (O(budget)); the rest goes at the next call. Returns how many
-- were dropped.
local function trim_log(K, budget, keep, maxlen, maxage, maxbytes, now)
  local top = read_meta(K.meta, {'seq', 'first'})
  local seq, first = tonumber(top[1] or '0'), tonumber(top[2] or '1')
  if budget <= 0 then return 0 end
  local head = past_gap(K.meta, first)  -- a gap at the head goes first: it holds nothing (lib/ids.lua)
  if head > first then
    expand_meta(K.meta)
    redis.call('HSET', K.meta, 'first', head)
    forget_gaps_below(K.meta, head)
    first = head
  end
  if first > seq then return 0 end
  -- the most this call may drop up to: within budget, and before the next gap
  local last = run_end(K.meta, first, math.min(seq, first + budget - 1))
  local upto = first - 1
  if maxlen > 0 then
    local kept = count_between(K.meta, first, seq)
    if kept > maxlen then upto = math.max(upto, position_after(K.meta, first, kept - maxlen) - 1) end
  end
  if not keep then
    local low = lowest_unsettled(K, first, seq)
    if low then upto = math.max(upto, low - 1) end
  end
  if maxbytes > 0 and upto < last then
    local size = redis.call('MEMORY', 'USAGE', K.log, 'SAMPLES', 16) or 0
    if size > maxbytes then
      local count = redis.call('HLEN', K.log)
      if count > 0 then upto = math.max(upto, first - 1 + math.ceil((size - maxbytes) * count / size)) end
    end
  end
  upto = math.min(upto, last)
  if maxage > 0 then
    while upto < last do
      local body = redis.call('HGET', K.log, upto + 1)
      if body and published_at(body) >= now - maxage then break end
      upto = upto + 1
    end
  end
  if upto < first then return 0 end
  local texts = int_strs(first, upto - first + 1)
  for i = 1, #texts, 1000 do
    redis.call('HDEL', K.log, unpack(texts, i, math.min(i + 999, #texts)))
  end
  expand_meta(K.meta)
  if prio_on(K) then trim_levels(K, first, upto + 1) else count_trimmed(K, first, upto + 1) end
  local head = past_gap(K.meta, upto + 1)
  redis.call('HSET', K.meta, 'first', head)
  forget_gaps_below(K.meta, head)
  return upto - first + 1
end

-- Settled messages below `first`: a dead letter replayed after its message
-- was trimmed brought its body back below the head (replay_dead.lua); once
-- settled, it goes, unless another group still holds it. `ids` as numbers.
-- Cost: O(ids below first · (groups + log n + the leases at or below them)),
-- nothing for the others.
local function forget_below_first(K, ids)
  local below = {}
  local first = tonumber(read_meta(K.meta, {'first'})[1] or '1')
  for _, id in ipairs(ids) do
    if id < first then below[#below + 1] = id end
  end
  if #below == 0 then return end
  local groups = read_meta(K.meta, {'groups'})[1]
  local list = groups and split(groups, '\n') or {}
  local delayed = redis.call('ZCARD', K.delayed) > 0 and redis.call('ZRANGE', K.delayed, 0, 999) or {}
  for _, id in ipairs(below) do
    local needed = is_checked_out(K, id)
    local padded = SEP .. pad(id) .. SEP
    for _, g in ipairs(list) do
      if needed then break end
      needed = #redis.call('ZRANGEBYLEX', K.ready, '[' .. g .. padded, '(' .. g .. SEP .. pad(id) .. '\1',
        'LIMIT', 0, 1) > 0
    end
    for _, member in ipairs(delayed) do
      if needed then break end
      needed = string.find(member, padded, 1, true) ~= nil
    end
    if not needed then redis.call('HDEL', K.log, id) end
  end
end
