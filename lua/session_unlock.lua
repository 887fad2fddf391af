-- session_unlock.lua: a cleaner that failed half-way lets go of the session, for the next sweep to finish.
--@include lib/base.lua
--@flags allow-oom
--
-- KEYS[1] ending
-- ARGV[1] token           the cleaner's: a lock that lapsed to another cleaner stays that one's
-- Returns: 1 when released, else 0.
-- Errors: none of its own.
if redis.call('GET', K.ending) ~= A.token then return 0 end
redis.call('DEL', K.ending)
return 1
