-- lib/meta.lua: a queue's meta hash: the compact form of an lmq at rest, and
-- a group's member list. Touches only the meta hash the caller passes (a key
-- the fence got in KEYS).
--@include lib/base.lua
--@include lib/ids.lua
--
-- Compact meta (lmqs at rest; docs/data-model.md, "Lmqs at rest"). Millions
-- of lite queues sit idle with one exclusive owner, and a meta hash that
-- spells out every default costs ~400 B each. At rest such a queue keeps only
-- what differs from the defaults below; `z` = "<group>|<owner>" stands for its
-- one group, member list and owner ("<owner>" alone when the group is the
-- lite default, `default`: 8 bytes less in every idle lmq; a client name has
-- no '|'), and the few fields left take one-letter
-- names (times to the second). Reads that may meet a compact hash go through
-- read_meta, which fills everything back in; a fence that writes meta expands
-- it first (expand_meta): some defaults are relative (cur = seq + 1, mem =
-- own), and a deleted field would come back as its default.
local function compact_names(g, m)
  return {'first', 'seq', gf(g, MODE), gf(g, POLICY), gf(g, EPOCH), gf(g, ON_PREEMPT), 'groups', gf(g, MEMBERS),
          mf(g, m, DELIVERED), mf(g, m, QOS), mf(g, m, ONLINE), 'jcap', gf(g, CURSOR)}
end

-- (`first` = seq + 1 is both a new queue's and one whose log is all consumed.)
local function compact_defaults(g, m, seq)
  local next_id = int_str(seq + 1)
  return {next_id, '0', 'exclusive', 'preempt', '0', 'keep', g, m, '0', '1', '1', '0', next_id}
end

-- Kept at rest under a short name: seq, tag, the owner's delivered count,
-- and the create / last-write times (the last two in seconds).
local SHORT_NAMES = {'S', 'T', 'N', 'C', 'W'}
local function long_names(g, m) return {'seq', 'tag', mf(g, m, DELIVERED), 'ct', 'wt'} end
local FIRST_TIME = 4

local LITE_GROUP = 'default'  -- a lite SUB's group when it names none

-- What a compact hash stands for but does not hold: a flat list {name,
-- value, ...}, or nil when the hash is not compact. Read once per call and
-- kept (false: not compact) until expand_meta or compact_meta changes the
-- form: a fence never writes a compact hash otherwise, so it cannot go stale.
local OMITTED = {}

-- What the compact hash whose fields `get` reads (HMGET-like: a list of names
-- in, their values or false out) stands for but does not hold, or nil.
local function omitted_by(get)
  local z = get({'z'})[1]
  if not z then return nil end
  local bar = string.find(z, '|', 1, true)
  local g, m = LITE_GROUP, z
  if bar then g, m = string.sub(z, 1, bar - 1), string.sub(z, bar + 1) end
  local out, kept = {gf(g, OWNER), m}, {}
  local short = get(SHORT_NAMES)
  for i, name in ipairs(long_names(g, m)) do
    local v = short[i]
    if v then
      if i >= FIRST_TIME then v = string.format('%d', tonumber(v) * 1000) end
      out[#out + 1] = name
      out[#out + 1] = v
      kept[name] = v
    end
  end
  local names = compact_names(g, m)
  local have = get(names)
  local defaults = compact_defaults(g, m, tonumber(kept.seq or '0'))
  for i, name in ipairs(names) do
    if not have[i] and not kept[name] then
      out[#out + 1] = name
      out[#out + 1] = defaults[i]
    end
  end
  return out
end

local function omitted_fields(meta)
  local known = OMITTED[meta]
  if known ~= nil then return known or nil end
  local out = omitted_by(function(names) return redis.call('HMGET', meta, unpack(names)) end)
  OMITTED[meta] = out or false
  return out
end

-- The same, of a hash given as its flat field, value list (an lmq at rest).
local function omitted_in(flat)
  local value = {}
  for i = 1, #flat, 2 do value[flat[i]] = flat[i + 1] end
  return omitted_by(function(names)
    local out = {}
    for i, name in ipairs(names) do out[i] = value[name] or false end
    return out
  end)
end

-- HMGET of meta fields, everything filled in when the hash is compact.
local function read_meta(meta, names)
  local n = #names
  names[n + 1] = 'z'
  local f = redis.call('HMGET', meta, unpack(names))
  names[n + 1] = nil
  local compact = f[n + 1]
  f[n + 1] = nil
  if compact then
    local omitted, value = omitted_fields(meta), {}
    for i = 1, #omitted, 2 do value[omitted[i]] = omitted[i + 1] end
    for i = 1, n do
      if not f[i] and value[names[i]] then f[i] = value[names[i]] end
    end
  end
  return f
end

-- Spell everything out again, before a write.
local function expand_meta(meta)
  local omitted = omitted_fields(meta)
  if not omitted then return end
  redis.call('HDEL', meta, 'z', unpack(SHORT_NAMES))
  redis.call('HSET', meta, unpack(omitted))
  OMITTED[meta] = false
end

-- Leave out every default, if the queue has one group whose only member is
-- its owner — only when all the defaulted fields are present, so expanding
-- gives back this hash (but for times below a second).
local function compact_meta(meta)
  local top = redis.call('HMGET', meta, 'groups', 'z')
  local g = top[1]
  if not g or top[2] or string.find(g, '\n', 1, true) then return end
  local gm = redis.call('HMGET', meta, gf(g, OWNER), gf(g, MEMBERS))
  local m = gm[1]
  if not m or gm[2] ~= m then return end
  local names = compact_names(g, m)
  local have = redis.call('HMGET', meta, unpack(names))
  for i = 1, #names do
    if not have[i] then return end
  end
  local defaults = compact_defaults(g, m, tonumber(have[2]))
  local drop = {gf(g, OWNER)}
  for i, name in ipairs(names) do
    if have[i] == defaults[i] then drop[#drop + 1] = name end
  end
  redis.call('HDEL', meta, unpack(drop))
  local longs = long_names(g, m)
  local values = redis.call('HMGET', meta, unpack(longs))
  local short = {'z', g == LITE_GROUP and m or (g .. '|' .. m)}
  for i, v in ipairs(values) do
    if v then
      if i >= FIRST_TIME then v = string.format('%d', math.floor(tonumber(v) / 1000)) end
      short[#short + 1] = SHORT_NAMES[i]
      short[#short + 1] = v
    end
  end
  redis.call('HDEL', meta, unpack(longs))
  redis.call('HSET', meta, unpack(short))
  OMITTED[meta] = nil
end

-- An lmq at rest without a key of its own (docs/data-model.md, "Lmqs at rest").
-- A key costs Redis ~120 B whatever it holds, more than a compact hash's
-- fields, so an lmq with one owner, nothing checked out and nothing in its
-- log keeps its compact hash as one field of its slot's rest hash (K.rest,
-- `<prefix>:{<slot tag>}:rest`; field: the queue id) and has no meta key.
-- Any fence that touches an lmq first puts the hash back (wake_from_rest):
-- the exact hash that rested, so nothing else in a fence needs to know. A
-- queue that is not an lmq names its own meta as K.rest: it never rests.
-- The value is cmsgpack of the hash's flat field, value list (a value that is
-- an integer in its canonical decimal form packed as one); one longer than
-- hash-max-listpack-value's default (64) would turn the whole rest hash of the
-- slot into a hashtable, so such an lmq keeps its key.
local REST_VALUE_MAX = 64
-- What the lmq may hold besides its meta and still rest: nothing in any of
-- these (those the fence declares; a fence that touches the lmq later wakes
-- it whatever else it holds, so one it cannot see is never lost).
local REST_EMPTY = {'log', 'checkouts', 'deadlines', 'owned', 'held', 'ready', 'delayed', 'dead', 'journal',
                    'scheduled', 'waiters', 'priority'}

local function rest_field(meta)
  return string.sub(meta, string.find(meta, '{', 1, true) + 1, -2)
end

-- The rested hash's flat field, value list, or nil when the lmq has its key
-- (or does not exist). Reads only: the snapshot fence's view of it.
local function rested_meta(K)
  if not K.rest or K.rest == K.meta or redis.call('EXISTS', K.meta) == 1 then return nil end
  local packed = redis.call('HGET', K.rest, rest_field(K.meta))
  if not packed then return nil end
  local flat = cmsgpack.unpack(packed)
  for i = 2, #flat, 2 do
    if type(flat[i]) == 'number' then flat[i] = int_str(flat[i]) end
  end
  return flat
end

-- Returns whether it woke the lmq (a fence that then changes nothing puts it
-- back: put_to_rest).
local function wake_from_rest(K)
  local flat = rested_meta(K)
  if not flat then return false end
  redis.call('HSET', K.meta, unpack(flat))
  redis.call('HDEL', K.rest, rest_field(K.meta))
  OMITTED[K.meta] = nil
  return true
end

-- The last write of a fence that may leave an lmq at rest (after compact_meta,
-- the reclaim TTL and the journal: nothing may read or write the meta key
-- after it). An lmq armed to be reclaimed expires as a key.
local function put_to_rest(K)
  if not K.rest or K.rest == K.meta then return end
  if redis.call('HEXISTS', K.meta, 'z') == 0 or redis.call('PTTL', K.meta) ~= -1 then return end
  local others = {}
  for _, name in ipairs(REST_EMPTY) do
    if K[name] then others[#others + 1] = K[name] end
  end
  if #others > 0 and redis.call('EXISTS', unpack(others)) > 0 then return end
  local flat = redis.call('HGETALL', K.meta)
  for i = 2, #flat, 2 do  -- an integer packs in 1 to 9 bytes: a 16-digit id or tag in 9, not 17
    local v = flat[i]
    local n = #v <= 16 and string.match(v, '^[1-9]%d*$') and tonumber(v)
    if n and n <= MAX_INT then flat[i] = n elseif v == '0' then flat[i] = 0 end
  end
  local packed = cmsgpack.pack(flat)
  if #packed > REST_VALUE_MAX then return end
  redis.call('HSET', K.rest, rest_field(K.meta), packed)
  redis.call('DEL', K.meta)
  OMITTED[K.meta] = nil
end

-- A group's members, in arrival order.
local function members_of(meta, g)
  local list = redis.call('HGET', meta, gf(g, MEMBERS))
  if not list or list == '' then return {} end
  return split(list, '\n')
end

local function set_members(meta, g, list)
  if #list == 0 then redis.call('HDEL', meta, gf(g, MEMBERS))
  else redis.call('HSET', meta, gf(g, MEMBERS), table.concat(list, '\n')) end
end

-- Where a queue's ids start: decided by the fence that gives it its first id
-- (publish, release). A plain topic starts at 1 on a server that has held its
-- slot's state from the start (lib/ids.lua, ids_from_one), else at the clock,
-- `now · 100`: it may be one lost whole in a failover or a restart (as long as
-- it took fewer than 100 ids per ms on average). A queue that can be deleted
-- and made again (an lmq reclaimed when idle, a filter queue dropped with its
-- last member: `from_clock`) starts at `now · 1000 + 1` (ms since the epoch,
-- times 1,000), so made again it starts above every id it gave before, as
-- long as it took fewer than 1,000 ids per ms on average (docs/data-model.md,
-- "Message ids"). A queue that gave ids before counts on from its seq, unless
-- another server gave them (lib/ids.lua, guard_ids). Returns the queue's seq,
-- and whether the queue is new (no `first` yet: the caller counts it). A
-- queue that never had a message has read nothing: every cursor is at its
-- start, and moves with it. O(groups), once per queue.
local function start_ids(K, now, from_clock)
  local top = redis.call('HMGET', K.meta, 'seq', 'first', 'groups', 'wt', 'srv')
  local seq = tonumber(top[1] or '0')
  if seq > 0 or (top[2] and top[5]) then return guard_ids(K.meta, now, seq, top[4], top[5]), false end
  local here = server_id()
  redis.call('HSET', K.meta, 'srv', here)
  if not from_clock and ids_from_one(K.totals, here) then
    if top[2] then return 0, false end
    redis.call('HSET', K.meta, 'first', 1)
    return 0, true
  end
  -- an lmq or a filter queue counts the clock in µs; a plain topic in tens of µs, so that, honouring
  -- priority, its ids stay below 2^48 (lib/priority.lua) until 2059
  seq = now * (from_clock and 1000 or 100)
  local start = int_str(seq + 1)
  local fields = {'seq', int_str(seq), 'first', start}
  for _, g in ipairs(top[3] and split(top[3], '\n') or {}) do
    fields[#fields + 1] = gf(g, CURSOR)
    fields[#fields + 1] = start
  end
  redis.call('HSET', K.meta, unpack(fields))
  return seq, not top[2]
end
