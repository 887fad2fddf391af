-- sweep.lua: return every checkout of one queue whose lease has expired.
--@include lib/members.lua
--@flags allow-oom
--
-- KEYS[1] meta
-- KEYS[2] log
-- KEYS[3] checkouts
-- KEYS[4] deadlines
-- KEYS[5] owned
-- KEYS[6] held
-- KEYS[7] ready
-- KEYS[8] delayed
-- KEYS[9] wake
-- KEYS[10] journal
-- KEYS[11] scheduled       messages published for later: when the first is due (the sweeper releases it)
-- KEYS[12] totals         the broker's totals (lib/totals.lua)
-- KEYS[13] backlogs
-- KEYS[14] rest           the slot's rest hash: an lmq at rest keeps its meta there (lib/meta.lua)
-- ARGV[1] limit           at most this many expired checkouts per call
-- Returns: {next due (-1 = nothing pending), returned,
--           {{group, member, {expired tags}, new active member or '', 1 if newly suspected}, ...},
--           when the first scheduled message is due (-1 = none): release.lua's when it is now}
-- Expired messages go back to the ready set in id order; a timeout counts as
-- an acquisition, not a failure, so it never pushes a message toward the
-- dead-letter limit. Each member that lost a lease becomes suspected. An
-- active single-active member that times out has all its checkouts returned
-- and the next member in arrival order that is not suspected takes over.
-- Idempotent: several workers may sweep the same queue at once. An lmq left
-- with nothing checked out is compacted and put to rest (lib/meta.lua).
-- Errors: none of its own.
-- Cost: O(expired · log n + due delayed); never a scan of live checkouts.
wake_from_rest(K)  -- an lmq at rest gets its meta key back first (lib/meta.lua)
expand_meta(K.meta)  -- this fence writes meta: no field may be left to a default
local limit = int_arg(A.limit, 'limit')
local now = now_ms()
local moved = promote_delayed(K, now)
-- the expired leases, a lease batch whole: at most `limit` checkouts and one batch more,
-- returned in the order of their deadlines, then of their tags as text (as one lease each were)
local due_leases = redis.call('ZRANGEBYSCORE', K.deadlines, '-inf', now, 'WITHSCORES', 'LIMIT', 0, limit)
local expired, due_of = {}, {}
for i = 1, #due_leases, 2 do
  if #expired >= limit then break end
  local lease = due_leases[i]
  local tags = tags_of_leases(K, {lease})
  if #tags == 0 then  -- nothing left under it (a batch whose last checkout went another way)
    redis.call('ZREM', K.deadlines, lease)
    redis.call('ZREM', K.held, lease)
    if string.sub(lease, 1, 1) == 'b' then redis.call('HDEL', K.checkouts, lease) end
  end
  for _, tag in ipairs(tags) do
    expired[#expired + 1] = tag
    due_of[tag] = tonumber(due_leases[i + 1])
  end
  -- a batch goes back whole: its holding entry goes now, not moved up tag by tag as each leaves it
  if #tags > 0 and string.sub(lease, 1, 1) == 'b' then redis.call('ZREM', K.held, lease) end
end
table.sort(expired, function(a, b) return due_of[a] < due_of[b] or (due_of[a] == due_of[b] and a < b) end)
local by_member, order = {}, {}
for _, tag in ipairs(expired) do
  local c = take_checkout(K, tag)
  if c then
    requeue(K, c, c.fail)
    tally(K, 'timeouts', 1)
    journal(now, 'timeout', c.group, c.member, c.id, tag, c.epoch)
    local key = c.group .. SEP .. c.member
    if not by_member[key] then
      by_member[key] = {c.group, c.member, {}}
      order[#order + 1] = key
    end
    table.insert(by_member[key][3], tag)
  else
    redis.call('ZREM', K.deadlines, tag)
  end
end

local notices = {}
for _, key in ipairs(order) do
  local g, m, tags = by_member[key][1], by_member[key][2], by_member[key][3]
  local successor, newly = '', 0
  if redis.call('HEXISTS', K.meta, mf(g, m, DELIVERED)) == 1 then
    if redis.call('HSETNX', K.meta, mf(g, m, SUSPECTED), now) == 1 then
      newly = 1
      tally(K, 'suspected', 1)
      journal(now, 'suspect', g, m)
    end
    -- kept with the suspicion, so the member's PULL or TAKE tells them again when the
    -- notice below never reaches it: a Redis failing over lost it, or the worker that swept
    redis.call('HSET', K.meta, mf(g, m, TIMED_OUT), table.concat(tags, ' ', 1, math.min(#tags, TIMED_OUT_KEPT)))
    local f = redis.call('HMGET', K.meta, gf(g, MODE), gf(g, OWNER))
    if f[1] == 'single-active' and f[2] == m then
      return_member_checkouts(K, g, m)
      -- The timed-out member goes to the back of the line; the next one in
      -- arrival order that is connected and not suspected takes over.
      local line = {}
      for _, other in ipairs(members_of(K.meta, g)) do
        if other ~= m then line[#line + 1] = other end
      end
      for _, other in ipairs(line) do
        if can_take_over(K.meta, g, other) then
          successor = other
          break
        end
      end
      line[#line + 1] = m
      set_members(K.meta, g, line)
      if successor == '' then redis.call('HDEL', K.meta, gf(g, OWNER))
      else redis.call('HSET', K.meta, gf(g, OWNER), successor) end
    end
  end
  notices[#notices + 1] = {g, m, tags, successor, newly}
end
flush_journal(K)
if #expired > 0 or moved > 0 then redis.call('SPUBLISH', K.wake, 'sweep') end
local s = redis.call('ZRANGE', K.scheduled, 0, 0, 'WITHSCORES')
local due = next_due(K)
-- An lmq's last call after its traffic is usually this sweep, of a lease its
-- ACK already settled: one with nothing checked out comes back to rest here
-- (compact, and without a key when it may: lib/meta.lua), as its ACK left it.
if K.rest ~= K.meta and redis.call('HLEN', K.checkouts) == 0 then
  compact_meta(K.meta)
  put_to_rest(K)
end
return {due, #expired, notices, s[2] and tonumber(s[2]) or -1}
