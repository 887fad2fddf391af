-- subscribe.lua: join (or create) a subscription of one queue as a member.
--@include _common.lua
-- (every fence: KEYS[last] is the queue's journal)
--@include _mailbox.lua
--
-- KEYS[1] meta  KEYS[2] log  KEYS[3] checkouts  KEYS[4] deadlines  KEYS[5] owned
-- KEYS[6] ready  KEYS[7] wake channel  KEYS[8] delayed  KEYS[9] dedup  KEYS[10] dedup ids
-- KEYS[11] dead letters
-- ARGV[1] group  ARGV[2] member
-- ARGV[3] mode asked for ('' = the group's, or ARGV[4] for a new group)
-- ARGV[4] default mode  ARGV[5] policy asked for ('' = the group's, else preempt)
-- ARGV[6] FROM kind for a new group: earliest | latest | id | time
-- ARGV[7] FROM argument (id or ms)   ARGV[8] member lock ms ('' = queue default)
-- ARGV[9] epoch the client knows ('' = none)   ARGV[10] MAX ('' = none)
-- ARGV[11] push mailbox capacity ('' = pull mode; the worker fills it with dispatch.lua)   ARGV[12] granted qos
-- ARGV[13] offset policy on preemption for a new group: keep | earliest | latest
-- ARGV[14] journal cap (0 = off)
-- ARGV[15] shared group strategy ('' = the group's, round-robin for a new one):
--   round-robin | sticky | hash   ARGV[16] skip offline members (1/0/'')
-- ARGV[17] 1 for an lmq: its meta hash is left compact (_common.lua, compact_meta)
-- Returns: {mode, epoch, owner, evicted member or '', checkouts returned, cursor,
--   1 if the caller became a new member else 0}
-- Exclusive groups: the last subscriber wins (preempt) — in this one call the
--   owner switches, an eviction marker is written for the old owner and its
--   checkouts go back to the queue; with POLICY reject a second client gets
--   BUSY instead. Subscribing again clears the caller's own marker and
--   suspicion. The epoch never goes down: a client that knows a higher one
--   raises the server's to it, so it never filters everything out.
-- Errors: BADARG (mode/policy conflict with the group), BUSY (reject policy).
-- Cost: O(checkouts of a preempted owner).
local K = {meta = KEYS[1], log = KEYS[2], co = KEYS[3], dl = KEYS[4], own = KEYS[5], rd = KEYS[6], wake = KEYS[7],
           dly = KEYS[8], dd = KEYS[9], ddm = KEYS[10], dead = KEYS[11], jr = KEYS[#KEYS]}
expand_meta(K.meta)  -- this fence writes meta: no field may be left to a default
local g, m = ARGV[1], ARGV[2]
local f = redis.call('HMGET', K.meta, gf(g, 'mode'), gf(g, 'pol'), gf(g, 'own'), gf(g, 'ep'), gf(g, 'cur'),
  'seq', 'first', mf(g, m, 'n'))
local existing_mode, existing_policy, owner = f[1], f[2], f[3]
local mode = ARGV[3] ~= '' and ARGV[3] or existing_mode or ARGV[4]
local policy = ARGV[5] ~= '' and ARGV[5] or existing_policy or 'preempt'
if existing_mode and mode ~= existing_mode then
  raise('BADARG', 'group ' .. g .. ' is ' .. existing_mode .. '; subscribe with MODE ' .. existing_mode .. ' or use another GROUP')
end
if existing_policy and policy ~= existing_policy then
  raise('BADARG', 'group ' .. g .. ' has POLICY ' .. existing_policy .. '; subscribe with that POLICY or use another GROUP')
end
local strategy = redis.call('HGET', K.meta, gf(g, 'strat'))
if existing_mode and ARGV[15] ~= '' and ARGV[15] ~= (strategy or 'round-robin') then
  raise('BADARG', 'group ' .. g .. ' uses STRATEGY ' .. (strategy or 'round-robin') .. ', chosen when it was created; use that or another group')
end
if mode == 'exclusive' and owner and owner ~= m and policy == 'reject' then
  raise('BUSY', 'group ' .. g .. ' is held by client ' .. owner .. ' (POLICY reject); wait for it to unsubscribe or use POLICY preempt')
end

local now = now_ms()
local seq, first = tonumber(f[6] or '0'), tonumber(f[7] or '1')
local epoch = tonumber(f[4] or '0')
local cur = tonumber(f[5] or '0')
if not existing_mode then
  local kind, arg = ARGV[6], ARGV[7]
  if kind == 'latest' then cur = seq + 1
  elseif kind == 'id' then cur = math.min(math.max(int_arg(arg, 'FROM ID'), first), seq + 1)
  elseif kind == 'time' then cur = first_at_or_after(K.log, first, seq, int_arg(arg, 'FROM TIME'))
  else cur = first end
  redis.call('HSETNX', K.meta, 'first', 1)
  redis.call('HSETNX', K.meta, 'seq', 0)
  redis.call('HSETNX', K.meta, 'ct', now)
  redis.call('HSET', K.meta, gf(g, 'mode'), mode, gf(g, 'pol'), policy, gf(g, 'ep'), epoch, gf(g, 'cur'), cur,
    gf(g, 'onpre'), ARGV[13] ~= '' and ARGV[13] or 'keep')
  if mode == 'shared' then
    redis.call('HSET', K.meta, gf(g, 'strat'), ARGV[15] ~= '' and ARGV[15] or 'round-robin')
    if ARGV[16] == '1' then redis.call('HSET', K.meta, gf(g, 'skip'), 1) end
  end
  local groups = redis.call('HGET', K.meta, 'groups')
  redis.call('HSET', K.meta, 'groups', groups and (groups .. '\n' .. g) or g)
end

if not f[8] then
  redis.call('HSET', K.meta, mf(g, m, 'n'), 0)
  revive(K)
  local list = members_of(K.meta, g)
  list[#list + 1] = m
  set_members(K.meta, g, list)
end
redis.call('HDEL', K.meta, mf(g, m, 'mk'), mf(g, m, 'fj'), mf(g, m, 'sus'))
local settings = {lock = ARGV[8], max = ARGV[10], cap = ARGV[11], qos = ARGV[12]}
for field, value in pairs(settings) do
  if value ~= '' then redis.call('HSET', K.meta, mf(g, m, field), value)
  else redis.call('HDEL', K.meta, mf(g, m, field)) end
end
redis.call('HDEL', K.meta, mf(g, m, 'end'))
redis.call('HSET', K.meta, mf(g, m, 'on'), 1)
if ARGV[11] ~= '' then push_list_add(K.meta, g, m) else push_list_remove(K.meta, g, m) end

local returned = 0
if ARGV[9] ~= '' and int_arg(ARGV[9], 'EPOCH') > epoch then
  -- The client saw a seek this server does not know (say, restored from an
  -- older copy): adopt its epoch; checkouts under the old one go stale and
  -- their messages back to the group, to be delivered under the new one.
  epoch = tonumber(ARGV[9])
  redis.call('HSET', K.meta, gf(g, 'ep'), epoch)
  returned = release_group_checkouts(K, g, true)
end

local evicted = ''
if mode == 'exclusive' and owner and owner ~= m then
  evicted = owner
  returned = returned + #return_member_checkouts(K, g, owner)
  redis.call('HSET', K.meta, mf(g, owner, 'mk'), m)
  local onpre = redis.call('HGET', K.meta, gf(g, 'onpre'))
  if onpre == 'earliest' then cur = first
  elseif onpre == 'latest' then cur = seq + 1 end
  if onpre ~= 'keep' then
    -- A cursor move is a seek: a new epoch, and nothing read before it.
    redis.call('HSET', K.meta, gf(g, 'cur'), cur)
    clear_group_backlog(K, g)
    epoch = redis.call('HINCRBY', K.meta, gf(g, 'ep'), 1)
  end
  journal(now, 'preempt', g, m, nil, nil, epoch, evicted)
  owner = m
elseif (mode == 'exclusive' or mode == 'single-active') and not owner then
  owner = m
end
if owner then redis.call('HSET', K.meta, gf(g, 'own'), owner) end
redis.call('HSET', K.meta, 'jcap', ARGV[14])
journal(now, 'sub', g, m, cur, nil, epoch, mode)
flush_journal(K)
if ARGV[17] == '1' then compact_meta(K.meta) end
if returned > 0 then redis.call('SPUBLISH', K.wake, 'preempt') end
return {mode, epoch, owner or '', evicted, returned, cur, f[8] and 0 or 1}
