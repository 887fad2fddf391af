-- presence.lua: mark a member online or offline (its session connected or not).
--@include _common.lua
-- (every fence: KEYS[last] is the queue's journal)
--
-- KEYS[1] meta  KEYS[2] journal
-- ARGV[1] group  ARGV[2] member  ARGV[3] 1 (online) or 0 (offline)
-- Returns: 1 if the member exists (and was marked), else 0 — never creates
--   state for a member that has left. Offline members of a shared group with
--   SKIP-OFFLINE get no new messages; others keep their share queued.
local meta, g, m = KEYS[1], ARGV[1], ARGV[2]
expand_meta(meta)  -- this fence writes meta: no field may be left to a default
if redis.call('HEXISTS', meta, mf(g, m, 'n')) == 0 then return 0 end
redis.call('HSET', meta, mf(g, m, 'on'), ARGV[3] == '1' and 1 or 0)
return 1
