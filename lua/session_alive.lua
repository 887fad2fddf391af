-- session_alive.lua: a connected session's lease moves on (its worker's keep-alive).
--@include lib/base.lua
--@flags allow-oom
--
-- KEYS[1] session
-- KEYS[2] ending
-- ARGV[1] lease_ms
-- Returns: the new lease deadline, or 0 when the session is gone or being
--   ended (a cleaner took it: the worker closes the connection, whose client
--   reconnects to a fresh session). A connected session is never left
--   without a lease: this sets it whatever it was.
-- Errors: BADARG when the lease is not an integer.
local lease = int_arg(A.lease_ms, 'lease', 1)
if redis.call('EXISTS', K.ending) == 1 or redis.call('EXISTS', K.session) == 0 then return 0 end
local deadline = now_ms() + lease
redis.call('HSET', K.session, 'lease', int_str(deadline))
return deadline
