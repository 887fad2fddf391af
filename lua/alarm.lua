-- alarm.lua: raise or clear one of the broker's alarms, the records every worker, the CLI and the UI read.
--@include lib/base.lua
--@flags allow-oom
--
-- KEYS[1] alarms          hash: alarm name -> "<raised at ms> <detail>"
-- ARGV[1] name            e.g. memory@10.0.0.5:6379 (broker/fences/memory.py)
-- ARGV[2] detail          what is wrong and what to do; '' clears the alarm
-- Returns: 1 when the alarm changed (raised, or cleared), 0 when it already was so.
--   A raised alarm keeps the time it was first raised, whoever raises it again.
-- Errors: none of its own.
-- Why a fence: an alarm goes up when Redis is short of memory, where Redis
--   refuses a plain HSET; this adds one field per alarm, at most.
if A.detail == '' then return redis.call('HDEL', K.alarms, A.name) end
return redis.call('HSETNX', K.alarms, A.name, int_str(now_ms()) .. ' ' .. A.detail)
