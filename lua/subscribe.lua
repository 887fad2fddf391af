-- subscribe.lua: join (or create) a subscription of one queue as a member.
--@include lib/seek.lua
--@include lib/mailbox.lua
--@flags none
--
-- Returns: {mode, epoch, owner, evicted member or '', checkouts returned, cursor,
--   1 if the caller became a new member else 0}
-- Errors: BADARG (mode/policy/strategy conflict with the group, a number that
--   is not an integer), BUSY (reject policy).
-- Cost: O(checkouts of a preempted owner).
--
-- KEYS[1] meta
-- KEYS[2] log
-- KEYS[3] checkouts
-- KEYS[4] deadlines
-- KEYS[5] owned
-- KEYS[6] held
-- KEYS[7] ready
-- KEYS[8] wake
-- KEYS[9] delayed
-- KEYS[10] dedup
-- KEYS[11] dedup_ids
-- KEYS[12] dead
-- KEYS[13] journal
-- KEYS[14] totals         the broker's totals (lib/totals.lua)
-- KEYS[15] backlogs
-- KEYS[16] priority       a priority queue's index of levels (lib/priority.lua)
-- KEYS[17] rest           the slot's rest hash: an lmq at rest keeps its meta there (lib/meta.lua)
-- ARGV[1] group
-- ARGV[2] member
-- ARGV[3] mode            asked for ('' = the group's, or default_mode for a new group)
-- ARGV[4] default_mode
-- ARGV[5] policy          asked for ('' = the group's, else preempt)
-- ARGV[6] from_kind       for a new group: earliest | latest | id | time
-- ARGV[7] from_arg        id or ms
-- ARGV[8] lock_ms         this member's lease length ('' = the queue's default)
-- ARGV[9] epoch           the epoch the client knows ('' = none)
-- ARGV[10] max            MAX ('' = none)
-- ARGV[11] capacity       push mailbox capacity ('' = pull mode; dispatch.lua fills it)
-- ARGV[12] qos            granted QoS
-- ARGV[13] on_preempt     offset policy on preemption for a new group: keep | earliest | latest
-- ARGV[14] journal_cap    (0 = off)
-- ARGV[15] strategy       of a shared group ('' = the group's, round-robin for a new one)
-- ARGV[16] offline        a shared group's offline members: 'queue' (QUEUE-OFFLINE), 'skip'
--   (SKIP-OFFLINE, the default) or '' (the group's)
-- ARGV[17] lite           1 for an lmq: its meta hash is left compact (lib/meta.lua)
-- Exclusive groups: the last subscriber wins (preempt) — in this one call the
--   owner switches, an eviction marker is written for the old owner and its
--   checkouts go back to the queue; with POLICY reject a second client gets
--   BUSY instead. Subscribing again clears the caller's own marker and
--   suspicion. The epoch never goes down: a client that knows a higher one
--   raises the server's to it, so it never filters everything out.
wake_from_rest(K)  -- an lmq at rest gets its meta key back first (lib/meta.lua)
local g, m = A.group, A.member
-- Everything is validated before the first write: Redis does not roll back a
-- script that fails half-way. (Waking an lmq at rest, above, changes where
-- its hash lies, not what it holds.)
local f = read_meta(K.meta, {gf(g, MODE), gf(g, POLICY), gf(g, OWNER), gf(g, EPOCH), gf(g, CURSOR),
  'seq', 'first', mf(g, m, DELIVERED), gf(g, STRATEGY), gf(g, ON_PREEMPT)})
local existing_mode, existing_policy, owner = f[1], f[2], f[3]
local mode = A.mode ~= '' and A.mode or existing_mode or A.default_mode
local policy = A.policy ~= '' and A.policy or existing_policy or 'preempt'
if existing_mode and mode ~= existing_mode then
  raise('BADARG', 'group ' .. g .. ' is ' .. existing_mode .. '; subscribe with MODE ' .. existing_mode .. ' or use another GROUP')
end
if existing_policy and policy ~= existing_policy then
  raise('BADARG', 'group ' .. g .. ' has POLICY ' .. existing_policy .. '; subscribe with that POLICY or use another GROUP')
end
local strategy = f[9]
if existing_mode == 'shared' and A.offline ~= '' then
  local queues_offline = redis.call('HGET', K.meta, gf(g, QUEUE_OFFLINE)) == '1'
  if queues_offline ~= (A.offline == 'queue') then
    raise('BADARG', 'group ' .. g .. (queues_offline and ' queues for' or ' skips') .. ' offline members, chosen when it was created; use that or another group')
  end
end
if existing_mode and A.strategy ~= '' and A.strategy ~= (strategy or 'round-robin') then
  raise('BADARG', 'group ' .. g .. ' uses STRATEGY ' .. (strategy or 'round-robin') .. ', chosen when it was created; use that or another group')
end
if mode == 'exclusive' and owner and owner ~= m and policy == 'reject' then
  raise('BUSY', 'group ' .. g .. ' is held by client ' .. owner .. ' (POLICY reject); wait for it to unsubscribe or use POLICY preempt')
end
local known_epoch = A.epoch ~= '' and int_arg(A.epoch, 'EPOCH') or nil
local settings = {}
for field, arg in pairs({[LOCK] = {A.lock_ms, 'LOCK', 1}, [MAX] = {A.max, 'MAX', 0},
                         [CAPACITY] = {A.capacity, 'CAPACITY', 1}, [QOS] = {A.qos, 'QOS', 0, 1}}) do
  settings[field] = arg[1] ~= '' and int_str(int_arg(arg[1], arg[2], arg[3], arg[4])) or false
end
local from_arg = (A.from_kind == 'id' or A.from_kind == 'time') and int_arg(A.from_arg, 'FROM ' .. A.from_kind) or nil
expand_meta(K.meta)  -- validated: now the writes, with no field left to a default
journal_on(K, A.journal_cap)

local now = now_ms()
local seq, first = tonumber(f[6] or '0'), tonumber(f[7] or '1')
local epoch = tonumber(f[4] or '0')
local cur = tonumber(f[5] or '0')
if not existing_mode then
  local kind = A.from_kind
  if kind == 'latest' then cur = seq + 1
  elseif kind == 'id' then cur = math.min(math.max(from_arg, first), seq + 1)
  elseif kind == 'time' then cur = first_at_or_after(K, first, seq, from_arg)
  else cur = first end
  if redis.call('HSETNX', K.meta, 'first', 1) == 1 then count_queue(K, 1) end
  add_total(K, READY, unread_of(K.meta, cur, first, seq))
  redis.call('HSETNX', K.meta, 'seq', 0)
  redis.call('HSETNX', K.meta, 'ct', now)
  redis.call('HSET', K.meta, gf(g, MODE), mode, gf(g, POLICY), policy, gf(g, EPOCH), epoch, gf(g, CURSOR), cur,
    gf(g, ON_PREEMPT), A.on_preempt ~= '' and A.on_preempt or 'keep')
  redis.call('HDEL', K.meta, gf(g, LEVEL_CURSORS))  -- a priority queue's levels all read from `cur` (lib/priority.lua)
  if mode == 'shared' then
    redis.call('HSET', K.meta, gf(g, STRATEGY), A.strategy ~= '' and A.strategy or 'round-robin')
    if A.offline == 'queue' then redis.call('HSET', K.meta, gf(g, QUEUE_OFFLINE), 1) end
  end
  local groups = redis.call('HGET', K.meta, 'groups')
  redis.call('HSET', K.meta, 'groups', groups and (groups .. '\n' .. g) or g)
end

if not f[8] then
  count_consumers(K, 1)
  revive(K)
  local list = members_of(K.meta, g)
  list[#list + 1] = m
  set_members(K.meta, g, list)
end
-- Subscribing again clears the member's marker, suspicion and end; its
-- settings are set or cleared: one HDEL and one HSET.
local set, unset = {mf(g, m, ONLINE), 1}, marker_fields(g, m)
unset[3], unset[4], unset[5] = mf(g, m, SUSPECTED), mf(g, m, ENDED), mf(g, m, TIMED_OUT)
if not f[8] then set[3], set[4] = mf(g, m, DELIVERED), 0 end  -- a new member
for field, value in pairs(settings) do
  if value then
    set[#set + 1] = mf(g, m, field)
    set[#set + 1] = value
  else
    unset[#unset + 1] = mf(g, m, field)
  end
end
uncount_member(K, g, m)
redis.call('HDEL', K.meta, unpack(unset))
redis.call('HSET', K.meta, unpack(set))
if A.capacity ~= '' then push_list_add(K.meta, g, m) else push_list_remove(K.meta, g, m) end

local returned = 0
if known_epoch and known_epoch > epoch then
  -- The client saw a seek this server does not know (say, restored from an
  -- older copy): adopt its epoch; checkouts under the old one go stale and
  -- their messages back to the group, to be delivered under the new one.
  epoch = known_epoch
  redis.call('HSET', K.meta, gf(g, EPOCH), epoch)
  returned = release_group_checkouts(K, g, true)
end

local evicted = ''
if mode == 'exclusive' and owner and owner ~= m then
  evicted = owner
  returned = returned + #mark_evicted(K, g, owner, m, CHURN_PREEMPT)
  local onpre = f[10]  -- the group exists (it has an owner): read with the rest
  if onpre == 'earliest' then cur = first
  elseif onpre == 'latest' then cur = seq + 1 end
  -- A cursor move is a seek: a new epoch, and nothing read before it.
  if onpre ~= 'keep' then epoch = move_cursor(K, g, cur) end
  journal(now, 'preempt', g, m, nil, nil, epoch, evicted)
  owner = m
elseif (mode == 'exclusive' or mode == 'single-active') and not owner then
  owner = m
end
if owner then redis.call('HSET', K.meta, gf(g, OWNER), owner, 'jcap', A.journal_cap)
else redis.call('HSET', K.meta, 'jcap', A.journal_cap) end
journal(now, 'sub', g, m, cur, nil, epoch, mode)
flush_journal(K)
if A.lite == '1' then
  compact_meta(K.meta)
  put_to_rest(K)
end
if returned > 0 then redis.call('SPUBLISH', K.wake, 'preempt') end
return {mode, epoch, owner or '', evicted, returned, cur, f[8] and 0 or 1}
