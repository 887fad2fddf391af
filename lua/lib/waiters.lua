-- lib/waiters.lua: long polls a publish hands its messages to (docs/data-model.md,
-- "Waiting long polls"). A PULL … BLOCK that found nothing registers in
-- K.waiters (zset: 'wid NUL group NUL member NUL count NUL since' scored by
-- when its wait ends, ms; since = the queue's last tag when it registered).
-- A publish made under a lease intent checks the new messages out to those
-- waiters (what their own PULL would have checked out, with the same gate)
-- and sends them with the wake-up, so the waiting worker answers without a
-- second fence call. A waiter whose record is gone when it looks again was
-- handed messages: they are its checkouts with a tag above `since`.
--@include lib/members.lua
--@include lib/reading.lua

-- At most this many bytes of message bodies go to one waiter in a wake-up
-- (what is left stays ready and the wake-up asks waiters to look): pub/sub
-- output buffers are small and closed when they overflow.
local HANDOFF_MAX_BYTES = 262144

local function waiter_record(wid, g, m, count, since)
  return wid .. SEP .. g .. SEP .. m .. SEP .. int_str(count) .. SEP .. since
end

-- Register a waiter that found nothing; its record lives until `until_ms`
-- (its BLOCK's end, plus a margin), and so does the key when it is the last.
-- Returns `since`.
local function register_waiter(K, wid, g, m, count, until_ms, now)
  local since = read_meta(K.meta, {'tag'})[1] or '0'
  redis.call('ZADD', K.waiters, until_ms, waiter_record(wid, g, m, count, since))
  if redis.call('PTTL', K.waiters) < until_ms - now then redis.call('PEXPIRE', K.waiters, until_ms - now) end
  return since
end

-- A member's checkouts with a tag above `since` (the messages handed to a
-- waiter registered then), oldest first: {tag, id, acquisitions, body} each.
-- O(its own checkouts).
local function handed_since(K, g, m, since)
  local out = {}
  local floor = tonumber(since)
  for _, tag in ipairs(member_tags(K, g, m)) do
    if tonumber(tag) > floor then
      local c = parse_checkout(tag, redis.call('HGET', K.checkouts, tag) or '')
      local body = c and redis.call('HGET', K.log, c.id)
      if body then out[#out + 1] = {tag, c.id, c.acq, body, c.fail} end
    end
  end
  table.sort(out, function(a, b) return tonumber(a[1]) < tonumber(b[1]) end)
  return out
end

-- Has some group of the queue something it could take now (a message past
-- its cursor, or one returned to it)? Then waiters not handed to should look.
local function anything_left(K, seq)
  local groups = read_meta(K.meta, {'groups'})[1]
  for _, g in ipairs(groups and split(groups, '\n') or {}) do
    local f = redis.call('HMGET', K.meta, gf(g, CURSOR), 'first')
    local cur = tonumber(f[1] or f[2] or '1')
    if count_between(K.meta, cur, seq) > 0 then return true end
    if #redis.call('ZRANGEBYLEX', K.ready, '[' .. g .. SEP, '(' .. g .. '\1', 'LIMIT', 0, 1) > 0 then return true end
  end
  return false
end

-- Hand the messages just published to the waiters (the first `limit` by the
-- end of their wait; expired records are dropped on the way). Each served
-- waiter's record goes; a fenced one (suspected, standby…) keeps its record and
-- gets nothing. Returns the wake-up message: 'H' .. msgpack {rest, wid1,
-- reply1, …} with each reply laid out as PULL's, rest = 1 when the other
-- waiters should still look (some group has something left, or there were
-- more waiters than `limit`) — or nil when nothing was handed —, the
-- earliest new deadline (-1: none), and whether a waiter whose id begins with
-- `local_wids` (the calling worker's, '' = none) was handed to. O(limit · count).
local function hand_off(K, now, default_lock, limit, seq, local_wids)
  local stale = redis.call('ZRANGEBYSCORE', K.waiters, '-inf', now - 1, 'LIMIT', 0, limit)
  if #stale > 0 then redis.call('ZREM', K.waiters, unpack(stale)) end
  local waiting = redis.call('ZRANGEBYSCORE', K.waiters, now, '+inf', 'LIMIT', 0, limit)
  local out, first_due, served, here = {0}, -1, 0, false
  local prefix_len = #(local_wids or '')
  for _, rec in ipairs(waiting) do
    local p = split(rec, SEP)
    local g, m = p[2], p[3]
    local ok, status, ep, member, count = pcall(delivery_gate, K, g, m, tonumber(p[4]))
    if not ok then
      redis.call('ZREM', K.waiters, rec)  -- its member left: nobody to hand to
    elseif status == 'ok' then
      local deadline = now + lock_of(K, member, default_lock)
      local taken = take_next(K, g, count, now)
      local bytes, keep = 0, #taken
      for i, t in ipairs(taken) do
        bytes = bytes + #t[4]
        if bytes > HANDOFF_MAX_BYTES and i > 1 then keep = i - 1; break end
      end
      if keep < #taken then
        put_back(K, g, taken, keep + 1)
        out[1] = 1
      end
      for i = #taken, keep + 1, -1 do taken[i] = nil end
      if #taken > 0 then
        lease_out(K, g, m, taken, ep, now, deadline, member.qos, true)
        redis.call('ZREM', K.waiters, rec)
        local reply = {ep, deadline, 'ok', 0, p[5]}
        for _, t in ipairs(taken) do
          reply[#reply + 1] = t[1]
          reply[#reply + 1] = t[2]
          reply[#reply + 1] = t[3]
          reply[#reply + 1] = t[4]
        end
        out[#out + 1] = p[1]
        out[#out + 1] = reply
        served = served + 1
        if prefix_len > 0 and string.sub(p[1], 1, prefix_len) == local_wids then here = true end
        if first_due < 0 or deadline < first_due then first_due = deadline end
      end
    end
  end
  if served == 0 then return nil, -1, false end
  if #waiting == limit or anything_left(K, seq) then out[1] = 1 end
  return 'H' .. cmsgpack.pack(out), first_due, here
end
