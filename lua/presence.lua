-- presence.lua: mark a member online or offline (its session connected or not).
--@include lib/meta.lua
--@flags allow-oom
--
-- KEYS[1] meta
-- KEYS[2] journal
-- KEYS[3] rest           the slot's rest hash: an lmq at rest keeps its meta there (lib/meta.lua)
-- ARGV[1] group
-- ARGV[2] member
-- ARGV[3] online          1 (online) or 0 (offline)
-- Returns: 1 if the member exists (and was marked), else 0 — never creates
--   state for a member that has left. Offline members of a shared group with
--   SKIP-OFFLINE get no new messages; others keep their share queued.
-- Errors: none of its own.
wake_from_rest(K)  -- an lmq at rest gets its meta key back first (lib/meta.lua)
local meta, g, m = K.meta, A.group, A.member
expand_meta(meta)  -- this fence writes meta: no field may be left to a default
if redis.call('HEXISTS', meta, mf(g, m, DELIVERED)) == 0 then return 0 end
redis.call('HSET', meta, mf(g, m, ONLINE), A.online == '1' and 1 or 0)
return 1
