-- session_linger.lua: the last connection of a session has gone; the session lives on for its own expiry.
--@include lib/base.lua
--@flags allow-oom
--
-- An MQTT client chooses how long its session outlives its connection (the
-- Session Expiry Interval, capped by the server): that, not the worker's
-- session_lease_ms, is the lease from now on. Only while no connection holds
-- the session: one that (re)bound meanwhile owns the lease.
--
-- KEYS[1] session
-- KEYS[2] ending
-- KEYS[3] conns
-- ARGV[1] lease_ms        how long the session may stay without a connection (>= 1)
-- Returns: the new lease deadline, or 0 when nothing was changed (the session
--   is gone, being ended, or has a connection again).
-- Errors: BADARG when the lease is not an integer >= 1.
local lease = int_arg(A.lease_ms, 'lease', 1)
if redis.call('EXISTS', K.ending) == 1 or redis.call('EXISTS', K.session) == 0 then return 0 end
if redis.call('SCARD', K.conns) > 0 then return 0 end
local deadline = now_ms() + lease
redis.call('HSET', K.session, 'lease', int_str(deadline))
return deadline
