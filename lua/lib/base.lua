-- lib/base.lua: what every fence needs: Redis time, coded errors, integer
-- arguments, splitting, and the names of the meta hash's fields.
-- Nothing here touches a key.

local SEP = '\0'

-- Milliseconds on Redis's clock: leases must agree across workers, so no
-- fence ever trusts the caller's clock.
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

-- Abort with a coded error (the code is the first word; every code is in
-- broker/errors.py). Fences validate before they write, so an error never
-- leaves a half-applied change behind (Redis does not roll a script back).
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

-- Integers are doubles here: exact up to 2^53 - 1, which bounds every integer
-- on the wire (docs/protocol.md, "Numbers"). tostring() and `..` write 10^14
-- as 1e+14, so every integer that goes into a stored string goes through
-- int_str (redis.call's own number arguments are exact).
local MAX_INT = 9007199254740991
local function int_str(n) return string.format('%d', n) end

-- The decimal strings of first, first + 1, ..., first + n - 1 (ids, tags):
-- one string.format per thousand values and a concat of three digits for
-- each (a format costs Redis ~1,200 instructions, the concat a third).
local DIGITS = {'0', '1', '2', '3', '4', '5', '6', '7', '8', '9'}
local function int_strs(first, n)
  local out, block, head = {}, -1, ''
  for i = 1, n do
    local v = first + i - 1
    local low = v % 1000
    local high = (v - low) / 1000
    local units, tens = low % 10, low % 100
    if high > 0 then
      if high ~= block then block, head = high, int_str(high) end
      out[i] = head .. DIGITS[(low - tens) / 100 + 1] .. DIGITS[(tens - units) / 10 + 1] .. DIGITS[units + 1]
    elseif v >= 100 then
      out[i] = DIGITS[(low - tens) / 100 + 1] .. DIGITS[(tens - units) / 10 + 1] .. DIGITS[units + 1]
    elseif v >= 10 then
      out[i] = DIGITS[(tens - units) / 10 + 1] .. DIGITS[units + 1]
    elseif v >= 0 then
      out[i] = DIGITS[units + 1]
    else
      out[i] = int_str(v)
    end
  end
  return out
end

-- A decimal integer argument within [lo, hi] (default 0 .. MAX_INT), else BADARG.
local function int_arg(v, name, lo, hi)
  lo, hi = lo or 0, hi or MAX_INT
  local n = type(v) == 'string' and string.match(v, '^%-?%d+$') and tonumber(v)
  if not n or n < lo or n > hi then
    raise('BADARG', name .. ' must be an integer from ' .. int_str(lo) .. ' to ' .. int_str(hi))
  end
  return n
end

local function pad(id) return string.format('%016d', id) end

-- Field names of the meta hash: g|<group>|<field> for a subscription (group),
-- m|<group>|<member>|<field> for one member. A concept keeps its name in the
-- code whatever short name it is stored under.
local function gf(g, f) return 'g|' .. g .. '|' .. f end
local function mf(g, m, f) return 'm|' .. g .. '|' .. m .. '|' .. f end

-- group fields
local MODE, POLICY, OWNER, EPOCH, CURSOR, MEMBERS = 'mode', 'pol', 'own', 'ep', 'cur', 'mem'
local ON_PREEMPT, STRATEGY, QUEUE_OFFLINE, RR_POINTER, STICKY = 'onpre', 'strat', 'qoff', 'rr', 'stk'
-- member fields
local DELIVERED, MAX, LOCK, SUSPECTED, MARKER, FENCE_LOGGED = 'n', 'max', 'lock', 'sus', 'mk', 'fj'
local CAPACITY, QOS, ENDED, ONLINE, TIMED_OUT = 'cap', 'qos', 'end', 'on', 'to'
local MEMBER_FIELDS = {DELIVERED, MAX, LOCK, SUSPECTED, MARKER, FENCE_LOGGED, CAPACITY, QOS, ENDED, ONLINE, TIMED_OUT}
-- A suspected member's PULL or TAKE tells it again which of its leases ran out (at most this many)
local TIMED_OUT_KEPT = 100
