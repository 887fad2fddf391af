-- session_notify.lua: queue notices for a session's next HEARTBEAT and announce them to its connections.
--@include lib/base.lua
--@flags allow-oom
--
-- KEYS[1] notices         list: the session's queued notices (msgpack maps)
-- KEYS[2] channel         the session's pub/sub channel (PUBLISH: its connections' workers listen)
-- ARGV[1] cap             notices kept at most: the oldest go
-- ARGV[2] announce        what is published: the notice, or the list of them (broker/fences/sessions.py)
-- ARGV[3..] notices
-- Returns: the number of notices the session has queued now.
-- Errors: BADARG when cap is not an integer of 1 or more.
-- Why a fence: notices (message_timeout after a sweep, unsubscribe after an eviction) must still be
--   told when Redis is at maxmemory, where a plain RPUSH is refused; a session keeps cap at most.
local cap = int_arg(A.cap, 'cap', 1)
for i = 1, #A.notices, 1000 do
  redis.call('RPUSH', K.notices, unpack(A.notices, i, math.min(i + 999, #A.notices)))
end
redis.call('LTRIM', K.notices, -cap, -1)
redis.call('PUBLISH', K.channel, A.announce)
return redis.call('LLEN', K.notices)
