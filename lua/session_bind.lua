-- session_bind.lua: a connection joins a client id's session (creating it), or takes it over.
--@include lib/base.lua
--@flags allow-oom
--
-- KEYS[1] session         the session hash (conn, worker, since, lease, gen)
-- KEYS[2] ending          the lock a cleaner holds while it ends the session
-- KEYS[3] conns           the set of connections that share the session (a client's pool)
-- ARGV[1] conn            the connection's token
-- ARGV[2] worker
-- ARGV[3] lease_ms
-- ARGV[4] takeover        1: the session's other connections lose it (the caller tells them to close)
-- Returns: {'bound', generation, lease deadline, connections sharing it} or
--   {'ending'} when the session is being ended right now: the caller waits for
--   the end and binds again, to a fresh session (ending is atomic against a
--   reconnect: a reconnect never finds a session half-ended).
-- Errors: BADARG when the lease is not an integer or takeover not 0 or 1.
local lease = int_arg(A.lease_ms, 'lease', 1)
local takeover = int_arg(A.takeover, 'takeover', 0, 1)
if redis.call('EXISTS', K.ending) == 1 then return {'ending'} end
local deadline = now_ms() + lease
local gen = redis.call('HINCRBY', K.session, 'gen', 1)
redis.call('HSET', K.session, 'conn', A.conn, 'worker', A.worker, 'since', int_str(now_ms()), 'lease', int_str(deadline))
if takeover == 1 then redis.call('DEL', K.conns) end
redis.call('SADD', K.conns, A.conn)
return {'bound', gen, deadline, redis.call('SCARD', K.conns)}
