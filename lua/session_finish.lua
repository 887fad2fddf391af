-- session_finish.lua: the last step of a session's end: its keys go, with the lock.
--@include lib/base.lua
--@flags allow-oom
--
-- KEYS[1] session
-- KEYS[2] ending
-- KEYS[3..] state         every other key of the session (index, notices, quota counts)
-- ARGV[1] token           the cleaner's: only the holder of the lock finishes
-- Returns: 1 when finished, 0 when the lock is not the caller's any more (it
--   lapsed and another cleaner took over: that one finishes).
-- Errors: none of its own.
if redis.call('GET', K.ending) ~= A.token then return 0 end
redis.call('DEL', K.session, K.ending, unpack(K.state))
return 1
