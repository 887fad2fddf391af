-- unpub.lua: cancel scheduled messages of one queue before they are due (lib/schedule.lua).
--@include lib/schedule.lua
--@flags allow-oom
--
-- KEYS[1] meta
-- KEYS[2] scheduled
-- KEYS[3] scheduled_bodies
-- KEYS[4] journal
-- KEYS[5] totals          the broker's totals (lib/totals.lua)
-- KEYS[6] backlogs
-- KEYS[7] rest           the slot's rest hash: an lmq at rest keeps its meta there (lib/meta.lua)
-- ARGV[1..] sids          schedule ids, as PUB … DELAY | AT answered them
-- Returns: how many were cancelled: a schedule id released already (its message is in the log,
--   with its own message id), cancelled before, or never given cancels nothing.
-- Errors: BADARG when an id is not a schedule id ('s' and digits, then 'p' and a level when
--   published with a PRIORITY).
-- Cost: O(ids · log n).
wake_from_rest(K)  -- an lmq at rest gets its meta key back first (lib/meta.lua)
for _, sid in ipairs(A.sids) do
  if not string.match(sid, '^s%d+$') and not string.match(sid, '^s%d+p%d$') then
    raise('BADARG', 'not a schedule id: UNPUB takes the ids PUB … DELAY | AT answered (s and digits)')
  end
end
local cancelled = cancel_scheduled(K, A.sids)
if cancelled > 0 and journal_on(K) then
  journal(now_ms(), 'unpub', nil, nil, nil, A.sids[1], nil, cancelled)
  flush_journal(K)
end
return cancelled
