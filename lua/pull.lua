-- pull.lua: check out up to COUNT messages for one member of a subscription.
--@include _common.lua
--
-- KEYS[1] meta  KEYS[2] log  KEYS[3] checkouts  KEYS[4] deadlines  KEYS[5] owned
-- KEYS[6] ready  KEYS[7] delayed
-- ARGV[1] group  ARGV[2] member  ARGV[3] count  ARGV[4] default lock ms
-- Returns: {epoch, deadline, status, tag1, id1, acquisitions1, body1, ...}
--   status 'ok' with 0..count deliveries, or a fence that yields none:
--   'evicted' (preempted; its old checkouts go back to the queue),
--   'suspected' (a lease expired; settle or RENEW first), 'standby' (not the
--   active member), 'ended' (its MAX is reached). deadline is the new leases'
--   deadline, -1 when none were made.
-- Errors: NOTFOUND when the member is not subscribed; BADARG on a bad count.
-- Cost: O(count + due delayed) — returned messages first, in id order, then
--   new ones from the cursor.
local K = {meta = KEYS[1], log = KEYS[2], co = KEYS[3], dl = KEYS[4], own = KEYS[5], rd = KEYS[6], dly = KEYS[7]}
local g, m = ARGV[1], ARGV[2]
local count = int_arg(ARGV[3], 'COUNT')
if count < 1 then raise('BADARG', 'COUNT must be at least 1') end

local f = redis.call('HMGET', K.meta, gf(g, 'mode'), gf(g, 'ep'), gf(g, 'own'), gf(g, 'cur'), 'seq', 'first',
  'lock', mf(g, m, 'n'), mf(g, m, 'max'), mf(g, m, 'mk'), mf(g, m, 'sus'), mf(g, m, 'lock'))
local mode, ep, owner = f[1], tonumber(f[2] or '0'), f[3]
if not mode or not f[8] then raise('NOTFOUND', 'not subscribed to this queue any more; SUB again for a new handle') end

if f[10] then
  return_member_checkouts(K, g, m)
  return {ep, -1, 'evicted'}
end
if f[11] then return {ep, -1, 'suspected'} end
if mode == 'exclusive' and owner ~= m then return {ep, -1, 'standby'} end
if mode == 'single-active' and owner ~= m then
  -- Take over from an active member that is gone or suspected: no deadlock.
  if owner and redis.call('HEXISTS', K.meta, mf(g, owner, 'n')) == 1
     and redis.call('HEXISTS', K.meta, mf(g, owner, 'sus')) == 0 then
    return {ep, -1, 'standby'}
  end
  redis.call('HSET', K.meta, gf(g, 'own'), m)
end
local delivered = tonumber(f[8])
if f[9] then
  local left = tonumber(f[9]) - delivered
  if left <= 0 then return {ep, -1, 'ended'} end
  if left < count then count = left end
end

local now = now_ms()
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
    if body then taken[#taken + 1] = {id, tonumber(p[3]) + 1, tonumber(p[4]), body} end
  end
end

local last, first = tonumber(f[5] or '0'), tonumber(f[6] or '1')
local cur = tonumber(f[4] or first)
if cur < first then cur = first end
local start = cur
while #taken < count and cur <= last do
  local body = redis.call('HGET', K.log, cur)
  if body then taken[#taken + 1] = {cur, 1, 0, body} end
  cur = cur + 1
end
if cur ~= start then redis.call('HSET', K.meta, gf(g, 'cur'), cur) end
if #taken == 0 then return {ep, -1, 'ok'} end

local lock = tonumber(f[12] or f[7] or ARGV[4])
local deadline = now + lock
local top = redis.call('HINCRBY', K.meta, 'tag', #taken)
redis.call('HINCRBY', K.meta, mf(g, m, 'n'), #taken)
local out = {ep, deadline, 'ok'}
local records, deadlines, owned = {}, {}, {}
for i, t in ipairs(taken) do
  local tag = tostring(top - #taken + i)
  records[#records + 1] = tag
  records[#records + 1] = table.concat({g, m, t[1], ep, t[2], t[3]}, SEP)
  deadlines[#deadlines + 1] = deadline
  deadlines[#deadlines + 1] = tag
  owned[#owned + 1] = 0
  owned[#owned + 1] = g .. SEP .. m .. SEP .. tag
  out[#out + 1] = tag
  out[#out + 1] = t[1]
  out[#out + 1] = t[2]
  out[#out + 1] = t[4]
end
redis.call('HSET', K.co, unpack(records))
redis.call('ZADD', K.dl, unpack(deadlines))
redis.call('ZADD', K.own, unpack(owned))
return out
