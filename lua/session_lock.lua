-- session_lock.lua: a cleaner takes a session to end it.
--@include lib/base.lua
--@flags allow-oom
--
-- KEYS[1] session
-- KEYS[2] ending
-- ARGV[1] token           the cleaner's
-- ARGV[2] ttl_ms          the lock lapses after this unless renewed (a cleaner that dies is followed by another)
-- ARGV[3] force           1: end it now whatever its lease (QUIT, an anonymous session's disconnect)
-- Returns: {'locked', lease} (the lease it ended, to unlist it by:
--   lua/session_unlist.lua), {'alive'} (its lease has not run out: it was
--   refreshed or rebound since it looked expired; nothing to do) or {'busy'}
--   (another cleaner holds it).
-- Errors: BADARG when the ttl is not an integer.
local ttl = int_arg(A.ttl_ms, 'ttl', 1)
local now = now_ms()
local lease = tonumber(redis.call('HGET', K.session, 'lease') or '0')
if A.force ~= '1' and lease > now then return {'alive'} end
if not redis.call('SET', K.ending, A.token, 'NX', 'PX', ttl) then return {'busy'} end
return {'locked', math.max(lease, now)}
