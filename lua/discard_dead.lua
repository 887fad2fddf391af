-- discard_dead.lua: drop one dead letter, if it is still the one an operator was shown.
--@include lib/totals.lua
--@include lib/meta.lua
--@flags allow-oom
--
-- KEYS[1] meta            (named only: the entry the dead letter counts under, lib/totals.lua)
-- KEYS[2] dead
-- KEYS[3] totals          the broker's totals
-- KEYS[4] backlogs
-- KEYS[5] rest           the slot's rest hash: an lmq at rest keeps its meta there (lib/meta.lua)
-- ARGV[1] position        where the operator saw it in the list
-- ARGV[2] entry           its exact bytes
-- Returns: 1 when it was dropped; 0 when that position holds another entry now (replayed or
--   discarded meanwhile): nothing is dropped then.
-- Errors: BADARG when position is not an integer of 0 or more.
-- Cost: O(position).
wake_from_rest(K)  -- an lmq at rest gets its meta key back first (lib/meta.lua)
local at = int_arg(A.position, 'position')
if redis.call('LINDEX', K.dead, at) ~= A.entry then return 0 end
local n = redis.call('LREM', K.dead, 1, A.entry)
add_total(K, DEAD, -n)
return n
