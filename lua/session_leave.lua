-- session_leave.lua: a connection that shared a session closes; how many still share it.
--@include lib/base.lua
--@flags allow-oom
--
-- When the last connection leaves, the session's lease runs from now: it
-- outlives its connection by ARGV[2] (the worker's session lease, or an MQTT
-- Session Expiry Interval), counted from this step, not from the last
-- keep-alive before it. The lease is set in the same step that makes the
-- session connectionless, so no moment exists in which the session has no
-- connection and an old lease (a worker behind with its keep-alives and
-- cleanups, say in a reconnect storm, would otherwise let a sweeper end a
-- session its client is entitled to resume).
--
-- KEYS[1] session
-- KEYS[2] ending
-- KEYS[3] conns           the set of connections that share the session
-- ARGV[1] conn            the closing connection's token
-- ARGV[2] lease_ms        how long the session outlives its last connection (0: its lease is left as it is)
-- Returns: {connections left sharing the session, the new lease deadline or 0}
--   (0 left: this was its last; the caller marks the client offline and
--   lists the deadline in the sessions index, or ends the session after a
--   QUIT). A connection the session no longer counts (taken over, or the
--   session ended meanwhile) changes nothing.
-- Errors: BADARG when the lease is not an integer >= 0.
local lease = int_arg(A.lease_ms, 'lease', 0)
redis.call('SREM', K.conns, A.conn)
local left = redis.call('SCARD', K.conns)
if left > 0 or lease == 0 then return {left, 0} end
if redis.call('EXISTS', K.ending) == 1 or redis.call('EXISTS', K.session) == 0 then return {0, 0} end
local deadline = now_ms() + lease
redis.call('HSET', K.session, 'lease', int_str(deadline))
return {0, deadline}
