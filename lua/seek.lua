-- seek.lua: move a subscription's cursor and raise its epoch.
--@include lib/seek.lua
--@include lib/members.lua
--@flags allow-oom
--
-- Returns: {new epoch, new cursor, clamped} (in full after ARGV)
-- Errors: NOTFOUND, STALE, NOPERM, BADARG (nothing changed) (in full after ARGV)
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
-- KEYS[11] totals         the broker's totals (lib/totals.lua)
-- KEYS[12] backlogs
-- KEYS[13] priority       a priority queue's index of levels (lib/priority.lua)
-- KEYS[14] rest           the slot's rest hash: an lmq at rest keeps its meta there (lib/meta.lua)
-- ARGV[1] group
-- ARGV[2] member          who seeks: it must be the group's active member
-- ARGV[3] operator        1: an operator's seek, which needs no membership
-- ARGV[4] kind            id | time | earliest | latest
-- ARGV[5] target          id or ms ('' for earliest/latest)
-- Returns, in full: {new epoch, new cursor, 1 if the target was below retention and
--   was clamped to the oldest retained message else 0}
-- Every checkout of the group taken under the old epoch is released (its tag
-- goes stale: ACK/RENEW of it settle nothing) and every returned or delayed
-- message of the group is dropped: after the seek the group reads from the
-- new cursor only. The epoch is raised inside this one atomic call, so it
-- only ever grows, across workers and concurrent seeks.
-- Errors, in full: NOTFOUND (no such subscription, or the caller is not a member),
--   STALE (the caller was evicted, or its subscription has ended), NOPERM (a
--   standby of an exclusive or single-active group), BADARG (bad target).
--   Nothing is changed then.
-- Cost: O(the group's checkouts + delayed messages of the queue + log2 n).
wake_from_rest(K)  -- an lmq at rest gets its meta key back first (lib/meta.lua)
local g, kind, arg = A.group, A.kind, A.target
local f = read_meta(K.meta, {gf(g, MODE), 'seq', 'first'})
if not f[1] then raise('NOTFOUND', 'no subscription ' .. g .. ' on this queue; SUB first') end
if A.operator ~= '1' then require_active_member(K.meta, g, A.member, 'SEEK') end
local seq, first = tonumber(f[2] or '0'), tonumber(f[3] or '1')
local cur, clamped
if kind == 'earliest' then cur = first
elseif kind == 'latest' then cur = seq + 1
elseif kind == 'id' then
  cur = int_arg(arg, 'SEEK ID', 1)
  if cur > seq + 1 then cur = seq + 1 end
elseif kind == 'time' then
  local ms = int_arg(arg, 'SEEK TIME')
  cur = first_at_or_after(K, first, seq, ms)
  -- below retention: the oldest retained message is newer than the target
  if cur == first and first > 1 then
    local body = redis.call('HGET', K.log, first)
    clamped = body and published_at(body) > ms
  end
else
  raise('BADARG', 'SEEK takes ID id, TIME ms, EARLIEST or LATEST')
end
if clamped == nil then clamped = cur < first end
if cur < first then cur = first end

expand_meta(K.meta)  -- validated: now the writes, with no field left to a default

local epoch = move_cursor(K, g, cur)
journal(now_ms(), 'seek', g, nil, cur, nil, epoch, kind)
flush_journal(K)
redis.call('SPUBLISH', K.wake, 'seek')
return {epoch, cur, clamped and 1 or 0}
