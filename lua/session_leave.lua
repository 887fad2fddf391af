-- session_leave.lua: a connection that shared a session closes; how many still share it.
--@include lib/base.lua
--@flags allow-oom
--
-- KEYS[1] conns           the set of connections that share the session
-- ARGV[1] conn            the closing connection's token
-- Returns: the connections left sharing the session (0: this was its last;
--   the caller marks the client offline, or ends the session after a QUIT).
--   A connection the session no longer counts (taken over, or the session
--   ended meanwhile) changes nothing.
-- Errors: none of its own.
redis.call('SREM', K.conns, A.conn)
return redis.call('SCARD', K.conns)
