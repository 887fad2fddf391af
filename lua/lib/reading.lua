-- lib/reading.lua: what a group reads next (take_next: returned messages first, then new ones
-- from its cursor, by level in a priority queue), putting back what it did not hand out, and a
-- checkout of what it read (check_out: take_next, then lib/leases.lua's lease_out).
--@include lib/leases.lua

-- The next `count` messages of group g, taken off it: returned ones first, in
-- id order, then new ones from the group's cursor (which moves past them); in a
-- priority queue, new ones by level, 9 first (lib/priority.lua).
-- An expired message met on the way is settled for the group without delivery
-- (its cursor passes it, a returned one leaves the ready set) and counted; the
-- cursor reads on past it, so a batch is still filled from what is live.
-- Returns a list of {nil, id, acquisitions, body, failures, id as text}: what
-- lease_out then checks out to a member. O(count + expired met + due delayed).
local function take_next(K, g, count, now)
  promote_delayed(K, now)
  local taken, gone = {}, {}
  local returned = redis.call('ZRANGEBYLEX', K.ready, '[' .. g .. SEP, '(' .. g .. '\1', 'LIMIT', 0, count)
  if #returned > 0 then
    add_total(K, READY, -redis.call('ZREM', K.ready, unpack(returned)))
    for _, member in ipairs(returned) do
      local p = split(member, SEP)
      local id = tonumber(p[2])
      local body = redis.call('HGET', K.log, id)
      -- a body trimmed by retention while pending is skipped, not delivered
      if body then
        if expired(body, now) then gone[#gone + 1] = id
        else taken[#taken + 1] = {nil, id, tonumber(p[3]) + 1, body, tonumber(p[4]), int_str(id)} end
      end
    end
  end
  local f = read_meta(K.meta, {gf(g, CURSOR), 'seq', 'first'})
  local last, first = tonumber(f[2] or '0'), tonumber(f[3] or '1')
  local cur = tonumber(f[1] or first)
  if cur < first then cur = first end
  if prio_on(K) then  -- a priority queue reads its levels, 9 first (lib/priority.lua)
    if #taken > 0 or #gone > 0 then expand_meta(K.meta) end
    if count - #taken > 0 and cur <= last then
      take_by_level(K, g, count - #taken, now, cur, last, taken, gone, expired)
    end
    count_expired(K, g, gone, now)
    return taken
  end
  cur = past_gap(K.meta, cur)  -- a gap is no message: stepped over, not counted (lib/ids.lua)
  local want = math.min(count - #taken, run_end(K.meta, cur, last) - cur + 1)
  -- an empty poll of a queue at rest writes nothing
  if want > 0 or #taken > 0 or #gone > 0 then expand_meta(K.meta) end
  local moved = false
  while want > 0 do
    local texts = int_strs(cur, want)  -- made once, and sent as text: redis.call formats a number each time
    local bodies = redis.call('HMGET', K.log, unpack(texts))
    for i = 1, want do
      local body = bodies[i]
      if body then
        if expired(body, now) then gone[#gone + 1] = cur + i - 1
        else taken[#taken + 1] = {nil, cur + i - 1, 1, body, 0, texts[i]} end
      end
    end
    cur = past_gap(K.meta, cur + want)
    add_total(K, READY, -want)
    moved = true
    want = math.min(count - #taken, run_end(K.meta, cur, last) - cur + 1)
  end
  if moved then redis.call('HSET', K.meta, gf(g, CURSOR), cur) end
  count_expired(K, g, gone, now)
  return taken
end

-- Undo take_next for taken[from..]: returned messages back to the ready set
-- (as they were), new ones (the tail: one acquisition) back under the cursor.
-- (Expired messages take_next met stay settled: they are not in `taken`; one
-- past a put-back message is met, and counted, again.)
local function put_back(K, g, taken, from)
  local back_to, by_level = nil, nil
  for i = from, #taken do
    local t = taken[i]
    if t[3] == 1 and t[7] then  -- a priority queue's (lib/priority.lua): back under its level's cursor
      by_level = by_level or {}
      if not by_level[t[7]] or t[2] < by_level[t[7]] then by_level[t[7]] = t[2] end
    elseif t[3] == 1 then
      if not back_to or t[2] < back_to then back_to = t[2] end
    else
      add_total(K, READY, redis.call('ZADD', K.ready, 0, ready_member(g, t[2], t[3] - 1, t[5])))
    end
  end
  if by_level then put_back_by_level(K, g, by_level) end
  if back_to then
    add_total(K, READY, count_between(K.meta, back_to, tonumber(redis.call('HGET', K.meta, gf(g, CURSOR))) - 1))
    redis.call('HSET', K.meta, gf(g, CURSOR), back_to)
  end
end

-- Check out up to `count` messages for member m (take_next, then lease_out;
-- `as_batch`: under one lease, as a PULL's).
-- Returns a list of {tag, id, acquisitions, body, failures, id as text}.
local function check_out(K, g, m, count, ep, now, deadline, member_qos, as_batch)
  return lease_out(K, g, m, take_next(K, g, count, now), ep, now, deadline, member_qos, as_batch)
end
