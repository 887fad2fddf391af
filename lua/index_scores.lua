-- index_scores.lua: set scores in one of the broker's index sorted sets (the lease schedule, the
-- sessions' and the workers' leases), whether Redis is full or not.
--@include lib/base.lua
--@flags allow-oom
--
-- KEYS[1] index
-- ARGV[1] mode            '' (set the score), GT or LT (only ever later, or sooner; a new member is added)
-- ARGV[2..] entries       pairs: score (an integer), member
-- Returns: how many members were added.
-- Errors: BADARG when the mode is none of these, the entries are not pairs or a score is not an integer.
-- Why a fence: this bookkeeping must go on when Redis is at maxmemory, where a plain ZADD is
--   refused: it moves the scores of members that are there, and adds one member per queue, session
--   or worker, at most (docs/operations.md, "Redis memory").
local mode = A.mode
if mode ~= '' and mode ~= 'GT' and mode ~= 'LT' then raise('BADARG', 'mode must be empty, GT or LT') end
if #A.entries == 0 or #A.entries % 2 ~= 0 then raise('BADARG', 'entries are (score, member) pairs') end
for i = 1, #A.entries, 2 do int_arg(A.entries[i], 'score') end
local added = 0
for i = 1, #A.entries, 2000 do  -- unpack has a limit: a thousand pairs at a time
  local last = math.min(i + 1999, #A.entries)
  if mode == '' then added = added + redis.call('ZADD', K.index, unpack(A.entries, i, last))
  else added = added + redis.call('ZADD', K.index, mode, unpack(A.entries, i, last)) end
end
return added
