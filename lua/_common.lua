-- _common.lua: helpers shared by the fences; included at load time by
-- broker/scripts.py wherever a script says `--@include _common.lua`.
-- Nothing here touches a key that the including script did not get in KEYS.
--
-- Encodings (see docs/data-model.md):
--   checkout record  group NUL member NUL id NUL epoch NUL acquisitions NUL failures
--   ready member     group NUL id(16 digits) NUL acquisitions NUL failures
--   owned member     group NUL member NUL tag
--   meta fields      g|<group>|<field>   m|<group>|<member>|<field>

local SEP = '\0'
local MEMBER_FIELDS = {'n', 'max', 'lock', 'sus', 'mk', 'fj', 'cap', 'qos', 'end', 'on'}

local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

-- Abort with a coded error. Callers validate before they write, so an error
-- never leaves a half-applied change behind.
local function raise(code, message)
  error({err = code .. ' ' .. message})
end

local function split(s, sep)
  local out, start = {}, 1
  while true do
    local i = string.find(s, sep, start, true)
    if not i then
      out[#out + 1] = string.sub(s, start)
      return out
    end
    out[#out + 1] = string.sub(s, start, i - 1)
    start = i + #sep
  end
end

local function gf(g, f) return 'g|' .. g .. '|' .. f end
local function mf(g, m, f) return 'm|' .. g .. '|' .. m .. '|' .. f end
local function pad(id) return string.format('%016d', id) end

--@include _compact_meta.lua

local function int_arg(v, name)
  local n = tonumber(v)
  if not n or n ~= math.floor(n) then raise('BADARG', name .. ' must be an integer, got ' .. tostring(v)) end
  return n
end

local function members_of(meta, g)
  local list = redis.call('HGET', meta, gf(g, 'mem'))
  if not list or list == '' then return {} end
  return split(list, '\n')
end

local function set_members(meta, g, list)
  if #list == 0 then redis.call('HDEL', meta, gf(g, 'mem'))
  else redis.call('HSET', meta, gf(g, 'mem'), table.concat(list, '\n')) end
end

local function parse_checkout(tag, rec)
  local g, m, id, ep, acq, fail = string.match(rec, '^([^%z]*)%z([^%z]*)%z(%d+)%z(%d+)%z(%d+)%z(%d+)$')
  return {tag = tag, group = g, member = m, id = tonumber(id), epoch = tonumber(ep),
          acq = tonumber(acq), fail = tonumber(fail)}
end

-- Remove a checkout (record, deadline, ownership). Returns it, or nil if the
-- tag is not checked out any more (settled, expired, or never existed).
local function take_checkout(K, tag)
  local rec = redis.call('HGET', K.co, tag)
  if not rec then return nil end
  local c = parse_checkout(tag, rec)
  redis.call('HDEL', K.co, tag)
  redis.call('ZREM', K.dl, tag)
  redis.call('ZREM', K.own, c.group .. SEP .. c.member .. SEP .. tag)
  return c
end

local function ready_member(g, id, acq, fail)
  return g .. SEP .. pad(id) .. SEP .. acq .. SEP .. fail
end

-- Put a returned message back where it was in id order, ahead of newer ones.
local function requeue(K, c, fail)
  redis.call('ZADD', K.rd, 0, ready_member(c.group, c.id, c.acq, fail))
end

-- Tags a member holds, in O(its own checkouts).
local function member_tags(K, g, m)
  local prefix = g .. SEP .. m .. SEP
  local owned = redis.call('ZRANGEBYLEX', K.own, '[' .. prefix, '(' .. g .. SEP .. m .. '\1')
  local tags = {}
  for i, member in ipairs(owned) do tags[i] = string.sub(member, #prefix + 1) end
  return tags
end

local function return_member_checkouts(K, g, m)
  local tags = member_tags(K, g, m)
  for _, tag in ipairs(tags) do
    local c = take_checkout(K, tag)
    if c then requeue(K, c, c.fail) end
  end
  return tags
end

-- The journal: compact events appended to a capped per-queue list in the
-- queue's own slot (snapshots carry it to the analytics). Buffered during a
-- call and written by flush_journal with one RPUSH and one LTRIM. The cap
-- lives in the meta hash (`jcap`, set by publish and subscribe from the
-- config); 0 turns the journal off.
-- Entry: ms TAB event TAB group TAB member TAB id TAB tag TAB epoch TAB extra
local JOURNAL, JOURNAL_N = {}, 0
local function journal(ms, ev, g, m, id, tag, ep, extra)
  JOURNAL_N = JOURNAL_N + 1
  JOURNAL[JOURNAL_N] = ms .. '\t' .. ev .. '\t' .. (g or '') .. '\t' .. (m or '') .. '\t' .. (id or '') .. '\t'
    .. (tag or '') .. '\t' .. (ep or '') .. '\t' .. (extra or '')
end

local function flush_journal(K)
  if JOURNAL_N == 0 then return end
  local cap = tonumber(redis.call('HGET', K.meta, 'jcap') or '0')
  if cap > 0 then
    for i = 1, #JOURNAL, 1000 do
      redis.call('RPUSH', K.jr, unpack(JOURNAL, i, math.min(i + 999, #JOURNAL)))
    end
    redis.call('LTRIM', K.jr, -cap, -1)
  end
  JOURNAL, JOURNAL_N = {}, 0
end

-- Every checkout of a group (all members): requeued, or released for good.
-- Cost: O(the group's checkouts).
local function release_group_checkouts(K, g, back_to_ready)
  local owned = redis.call('ZRANGEBYLEX', K.own, '[' .. g .. SEP, '(' .. g .. '\1')
  for _, member in ipairs(owned) do
    local c = take_checkout(K, split(member, SEP)[3])
    if c and back_to_ready then requeue(K, c, c.fail) end
  end
  return #owned
end

-- Forget the group's returned and delayed messages: its cursor moved.
-- Cost: O(the queue's delayed messages).
local function clear_group_backlog(K, g)
  redis.call('ZREMRANGEBYLEX', K.rd, '[' .. g .. SEP, '(' .. g .. '\1')
  local prefix = g .. SEP
  local stale = {}
  for _, member in ipairs(redis.call('ZRANGE', K.dly, 0, -1)) do
    if string.sub(member, 1, #prefix) == prefix then stale[#stale + 1] = member end
  end
  if #stale > 0 then redis.call('ZREM', K.dly, unpack(stale)) end
end

-- A checkout taken under an epoch older than its group's is stale: ACK,
-- NACK and RENEW of it settle nothing.
local function group_epoch(meta, g)
  return tonumber(redis.call('HGET', meta, gf(g, 'ep')) or '0')
end

-- Remove a member from its group: fields and arrival-order slot. An
-- exclusive group loses its owner; a single-active one hands over to the next
-- member in arrival order that is not suspected. Returns the owner after.
-- May this member become the active one of a single-active group? Not if it
-- is suspected, nor while its session has no connection.
local function can_take_over(meta, g, m)
  local f = read_meta(meta, {mf(g, m, 'n'), mf(g, m, 'sus'), mf(g, m, 'on')})
  return f[1] and not f[2] and f[3] ~= '0'
end

local function remove_member(K, g, m)
  for _, field in ipairs(MEMBER_FIELDS) do redis.call('HDEL', K.meta, mf(g, m, field)) end
  local rest = {}
  for _, other in ipairs(members_of(K.meta, g)) do
    if other ~= m then rest[#rest + 1] = other end
  end
  set_members(K.meta, g, rest)
  local f = redis.call('HMGET', K.meta, gf(g, 'mode'), gf(g, 'own'))
  local owner = f[2]
  if owner == m then
    owner = nil
    if f[1] == 'single-active' then
      for _, other in ipairs(rest) do
        if can_take_over(K.meta, g, other) then owner = other; break end
      end
    end
    if owner then redis.call('HSET', K.meta, gf(g, 'own'), owner) else redis.call('HDEL', K.meta, gf(g, 'own')) end
  end
  return owner
end

local function promote_delayed(K, now)
  local due = redis.call('ZRANGEBYSCORE', K.dly, '-inf', now, 'LIMIT', 0, 1000)
  if #due > 0 then
    for _, member in ipairs(due) do redis.call('ZADD', K.rd, 0, member) end
    redis.call('ZREM', K.dly, unpack(due))
  end
  return #due
end

-- Earliest moment something in this queue is due (a lease deadline or a
-- delayed redelivery), or -1: the worker keeps the global schedule with it.
local function next_due(K)
  local best = -1
  local d = redis.call('ZRANGE', K.dl, 0, 0, 'WITHSCORES')
  if d[2] then best = tonumber(d[2]) end
  local l = redis.call('ZRANGE', K.dly, 0, 0, 'WITHSCORES')
  if l[2] and (best < 0 or tonumber(l[2]) < best) then best = tonumber(l[2]) end
  return best
end

-- A consumer that settles or renews is no longer suspected. In single-active
-- mode it takes over when the active member is gone or suspected itself, so a
-- group whose members all timed out never deadlocks.
local function clear_suspicion(meta, g, m)
  redis.call('HDEL', meta, mf(g, m, 'sus'))
end

local function published_at(body)
  return tonumber(string.match(body, '^(%d+):'))
end

-- First retained id published at or after `ms` (seq + 1 when none): a binary
-- search over the log, since ids are assigned in publish-time order.
local function first_at_or_after(log, first, seq, ms)
  local lo, hi = first, seq + 1
  while lo < hi do
    local mid = math.floor((lo + hi) / 2)
    local body = redis.call('HGET', log, mid)
    if body and published_at(body) >= ms then hi = mid else lo = mid + 1 end
  end
  return lo
end

-- May member m of group g receive messages now, and how many at most?
-- Returns status ('ok' or the fence that stops it), epoch, the member's
-- state fields, and the count allowed by its MAX.
local function delivery_gate(K, g, m, count)
  local f = read_meta(K.meta, {gf(g, 'mode'), gf(g, 'ep'), gf(g, 'own'), mf(g, m, 'n'),
    mf(g, m, 'max'), mf(g, m, 'mk'), mf(g, m, 'sus'), mf(g, m, 'lock'), mf(g, m, 'cap'), mf(g, m, 'end'),
    mf(g, m, 'qos'), mf(g, m, 'on')})
  local mode, ep, owner = f[1], tonumber(f[2] or '0'), f[3]
  if not mode or not f[4] then raise('NOTFOUND', 'not subscribed to this queue any more; SUB again for a new handle') end
  local member = {lock = f[8], cap = f[9], ended = f[10], delivered = tonumber(f[4]), max = f[5],
                  qos = tonumber(f[11] or '1'), online = f[12] ~= '0'}
  if f[6] then
    -- Evicted: fenced. Whatever it still holds goes back for the new owner.
    return_member_checkouts(K, g, m)
    expand_meta(K.meta)
    -- journaled once per eviction: a client polling in a loop must not flood
    -- the journal (and push the preempt event itself out of it)
    if redis.call('HSETNX', K.meta, mf(g, m, 'fj'), 1) == 1 then
      journal(now_ms(), 'fenced', g, m, nil, nil, ep, f[6])
    end
    return 'evicted', ep, member, 0
  end
  if f[7] then return 'suspected', ep, member, 0 end
  if f[10] then return 'ended', ep, member, 0 end
  if mode == 'exclusive' and owner ~= m then return 'standby', ep, member, 0 end
  if mode == 'single-active' and owner ~= m then
    -- Take over from an active member that is gone, suspected or
    -- disconnected: no deadlock, and no stall behind a dropped connection.
    if owner and can_take_over(K.meta, g, owner) then
      return 'standby', ep, member, 0
    end
    -- What the old active member still holds comes back first, so the group's
    -- order survives the handover (its late ACKs settle nothing).
    if owner and owner ~= m then return_member_checkouts(K, g, owner) end
    expand_meta(K.meta)
    redis.call('HSET', K.meta, gf(g, 'own'), m)
  end
  if f[5] then
    local left = tonumber(f[5]) - member.delivered
    if left <= 0 then return 'ended', ep, member, 0 end
    if left < count then count = left end
  end
  return 'ok', ep, member, count
end

-- Check out up to `count` messages for member m: returned ones first, in id
-- order, then new ones from the group's cursor. Each gets a fresh tag, a
-- record and an ownership entry; a deadline only when `deadline` is given (a
-- push mailbox starts the lease when the consumer TAKEs the message).
-- Granted QoS is min(member's, message's): a QoS 0 delivery is at most once —
-- no record, no lease, never redelivered — and its tag starts with 'q'.
-- Returns a list of {tag, id, acquisitions, body}. O(count + due delayed).
local function check_out(K, g, m, count, ep, now, deadline, member_qos)
  promote_delayed(K, now)
  local taken = {}
  local returned = redis.call('ZRANGEBYLEX', K.rd, '[' .. g .. SEP, '(' .. g .. '\1', 'LIMIT', 0, count)
  if #returned > 0 then
    redis.call('ZREM', K.rd, unpack(returned))
    for _, member in ipairs(returned) do
      local p = split(member, SEP)
      local id = tonumber(p[2])
      local body = redis.call('HGET', K.log, id)
      -- a body trimmed by retention while pending is skipped, not delivered
      if body then taken[#taken + 1] = {nil, id, tonumber(p[3]) + 1, body, tonumber(p[4])} end
    end
  end
  local f = read_meta(K.meta, {gf(g, 'cur'), 'seq', 'first'})
  local last, first = tonumber(f[2] or '0'), tonumber(f[3] or '1')
  local cur = tonumber(f[1] or first)
  if cur < first then cur = first end
  local want = math.min(count - #taken, last - cur + 1)
  -- an empty poll of a queue at rest writes nothing
  if want > 0 or #taken > 0 then expand_meta(K.meta) end
  if want > 0 then
    local ids = {}
    for i = 1, want do ids[i] = cur + i - 1 end
    local bodies = redis.call('HMGET', K.log, unpack(ids))
    for i = 1, want do
      if bodies[i] then taken[#taken + 1] = {nil, ids[i], 1, bodies[i], 0} end
    end
    redis.call('HSET', K.meta, gf(g, 'cur'), cur + want)
  end
  if #taken == 0 then return taken end

  local top = redis.call('HINCRBY', K.meta, 'tag', #taken)
  redis.call('HINCRBY', K.meta, mf(g, m, 'n'), #taken)
  local records, deadlines, owned, n = {}, {}, {}, 0
  local gm = g .. SEP .. m .. SEP
  local base = top - #taken
  for i, t in ipairs(taken) do
    local tag = tostring(base + i)
    t[1] = tag
    if member_qos == 0 or string.byte(t[4], string.find(t[4], ':', 1, true) + 1) == 48 then  -- '0': QoS 0
      t[1] = 'q' .. tag
    else
      n = n + 2
      records[n - 1] = tag
      records[n] = gm .. t[2] .. SEP .. ep .. SEP .. t[3] .. SEP .. t[5]
      deadlines[n - 1] = deadline
      deadlines[n] = tag
      owned[n - 1] = 0
      owned[n] = gm .. tag
    end
    journal(now, 'out', g, m, t[2], t[1], ep, t[3])
  end
  if n == 0 then return taken end
  redis.call('HSET', K.co, unpack(records))
  if deadline then redis.call('ZADD', K.dl, unpack(deadlines)) end
  redis.call('ZADD', K.own, unpack(owned))
  return taken
end

local function lock_of(K, member, default)
  return tonumber(member.lock or redis.call('HGET', K.meta, 'lock') or default)
end

-- Every key an lmq can have but mailboxes: what reclaiming it expires.
local LMQ_KEYS = {'meta', 'log', 'jr', 'dd', 'ddm', 'dead'}

-- An lmq at rest (docs/data-model.md, "Lmqs at rest") with nothing checked
-- out, returned or delayed:
-- * forgets the messages every group has read, so its log holds only what
--   someone may still get — at most 1000 per call (O(batch)); retention trims
--   the rest at the next publish. An lmq without groups keeps its messages
--   for its first subscriber, and one with a group that rewinds to the
--   earliest message on preemption keeps them for that rewind;
-- * is reclaimed after an idle TTL when nobody owns it or has anything left
--   to read: its keys get that expiry now, and lose it at the next write that
--   gives it an owner or a message to read (the caller passes the TTL for
--   lmqs only, 0 for plain topics, which are never reclaimed).
-- Then, nothing being checked out, its meta hash may come to rest compact.
-- One look at each group serves both. Cost: O(groups + messages dropped).
local function drop_consumed(K, first, upto)
  upto = math.min(upto, first + 999)
  if upto < first then return end
  local ids = {}
  for id = first, upto do ids[#ids + 1] = id end
  redis.call('HDEL', K.log, unpack(ids))
  expand_meta(K.meta)
  redis.call('HSET', K.meta, 'first', upto + 1)
end

local function reclaim_if_idle(K, ttl_ms)
  if not ttl_ms or ttl_ms <= 0 then return end
  local settled = redis.call('HLEN', K.co) == 0
  local idle = settled and redis.call('ZCARD', K.rd) == 0 and redis.call('ZCARD', K.dly) == 0
  if idle then
    local top = read_meta(K.meta, {'seq', 'groups', 'first'})
    local seq, groups, first = tonumber(top[1] or '0'), top[2], tonumber(top[3] or '1')
    local read_by_all, rewinds = nil, false
    for _, g in ipairs(groups and split(groups, '\n') or {}) do
      local f = read_meta(K.meta, {gf(g, 'own'), gf(g, 'mem'), gf(g, 'cur'), gf(g, 'onpre')})
      local cur = tonumber(f[3] or first)
      if f[1] or f[2] or cur <= seq then idle = false end
      if f[4] == 'earliest' then rewinds = true end
      if not read_by_all or cur - 1 < read_by_all then read_by_all = cur - 1 end
    end
    if not groups and seq > 0 then idle = false end
    if read_by_all and not rewinds then drop_consumed(K, first, read_by_all) end
  end
  if settled then compact_meta(K.meta) end
  -- Every key an lmq can have but mailboxes (gone with their members).
  for _, name in ipairs(LMQ_KEYS) do
    local key = K[name]
    if key then
      if idle then redis.call('PEXPIRE', key, ttl_ms) else redis.call('PERSIST', key) end
    end
  end
end

-- A write that gives the queue an owner or a message revives it: no key may
-- keep the reclaim TTL (the caller declares all of LMQ_KEYS).
local function revive(K)
  for _, name in ipairs(LMQ_KEYS) do
    if K[name] then redis.call('PERSIST', K[name]) end
  end
end
