-- session_unlist.lua: an ended session leaves the index of leases, unless it was bound again meanwhile.
--@include lib/base.lua
--@flags allow-oom
--
-- KEYS[1] sessions        zset: client id -> lease deadline (how cleaners find expired sessions)
-- ARGV[1] client
-- ARGV[2] upto            the lease the session ended with (session_lock.lua's reply)
-- Returns: 1 when removed, 0 when its entry is later (bound again since: it stays listed).
-- Errors: none of its own.
local score = redis.call('ZSCORE', K.sessions, A.client)
if score and tonumber(score) > int_arg(A.upto, 'upto') then return 0 end
redis.call('ZREM', K.sessions, A.client)
return 1
