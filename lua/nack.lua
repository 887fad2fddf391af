-- nack.lua: return checkouts of one member to the queue, later, or for good.
--@include lib/retention.lua
--@flags allow-oom
--
-- Returns: {returned, dead-lettered, due, push} (in full after ARGV)
-- Errors: BADARG (in full after ARGV)
-- KEYS[1] meta
-- KEYS[2] log
-- KEYS[3] checkouts
-- KEYS[4] deadlines
-- KEYS[5] owned
-- KEYS[6] held
-- KEYS[7] ready
-- KEYS[8] delayed
-- KEYS[9] dead
-- KEYS[10] wake
-- KEYS[11] journal
-- KEYS[12] totals         the broker's totals (lib/totals.lua)
-- KEYS[13] backlogs
-- KEYS[14] priority       a priority queue's index of levels (lib/priority.lua)
-- KEYS[15] rest           the slot's rest hash: an lmq at rest keeps its meta there (lib/meta.lua)
-- ARGV[1] group
-- ARGV[2] member
-- ARGV[3] delay_ms        0 = now
-- ARGV[4] discard         1/0
-- ARGV[5] max_failures    default NACKs before dead-lettering (0 = never)
-- ARGV[6] release         1/0: hand back unprocessed (no failure counted, never dead-lettered)
-- ARGV[7] keep            1: the topic has a retention policy (lib/retention.lua); 0: settled messages go
-- ARGV[8] maxlen          messages kept at most, whatever their state (0 = no limit)
-- ARGV[9] maxage_ms       (0 = no limit)
-- ARGV[10] maxbytes       (0 = no limit)
-- ARGV[11..] tags
-- Returns, in full: {returned, dead-lettered, due, push}: checkouts returned (or discarded),
--   how many of them went to the dead-letter list, when delayed ones
--   become ready (-1 when none were delayed), and the queue's push members
--   (meta field push) when some went back to their group now ('' else): a
--   push group's members take only from their mailboxes, so the worker
--   dispatches to them at once, without reading them in a round trip of its own.
-- A NACK counts a failure; at the limit the message goes to the dead-letter
-- list instead of back to the queue. DISCARD drops it (no redelivery).
-- RELEASE hands back what a consumer fetched and never processed (an SDK
-- iterator left early): no failure is counted, so it cannot dead-letter.
-- A message discarded or dead-lettered is settled: the log's head is then
-- trimmed as ACK trims it (lib/retention.lua); a dead letter carries its
-- message (replay_dead.lua puts it back).
-- Errors, in full: BADARG when DELAY or a retention limit is not an integer of 0 or more.
-- Cost: O(tags + groups · log n).
wake_from_rest(K)  -- an lmq at rest gets its meta key back first (lib/meta.lua)
local g, m = A.group, A.member
local delay = int_arg(A.delay_ms, 'DELAY')
local maxlen = int_arg(A.maxlen, 'MAXLEN')
local maxage = int_arg(A.maxage_ms, 'MAXAGE')
local maxbytes = int_arg(A.maxbytes, 'MAXBYTES')
local discard = A.discard == '1'
local release = A.release == '1'
expand_meta(K.meta)  -- validated: now the writes, with no field left to a default
local maxfail = tonumber(redis.call('HGET', K.meta, 'maxdel') or A.max_failures)
local now = now_ms()
local epoch = group_epoch(K.meta, g)
local returned, dead, woke, requeued = 0, 0, false, false
local gone = {}  -- ids discarded or dead-lettered: settled for this group
for _, tag in ipairs(A.tags) do
  local rec = redis.call('HGET', K.checkouts, tag)
  local c = rec and parse_checkout(tag, rec)
  if settles(c, g, m, epoch, c and deadline_of(K, c), now) then
    take_checkout(K, tag)
    returned = returned + 1
    local fail = release and c.fail or c.fail + 1
    journal(now, discard and 'discard' or 'nack', g, m, c.id, c.tag, c.epoch, fail)
    if discard then gone[#gone + 1] = c.id end
    if not discard then
      if not release and maxfail > 0 and fail >= maxfail then
        local body = redis.call('HGET', K.log, c.id)
        if body then
          redis.call('RPUSH', K.dead, cmsgpack.pack({c.id, g, m, c.acq, fail, now, body}))
          add_total(K, DEAD, 1)
        end
        dead = dead + 1
        gone[#gone + 1] = c.id
        journal(now, 'dead', g, m, c.id, c.tag, c.epoch, fail)
      elseif delay > 0 then
        add_total(K, DELAYED, redis.call('ZADD', K.delayed, now + delay, ready_member(g, c.id, c.acq, fail)))
      else
        requeue(K, c, fail)
        woke, requeued = true, true
      end
    end
  end
end
tally(K, 'nacked', returned)
tally(K, 'dead_lettered', dead)
if #gone > 0 then
  forget_below_first(K, gone)
  trim_log(K, #gone + 100, A.keep == '1', maxlen, maxage, maxbytes, now)
end
-- alive, even if every tag had expired: a long poll it has waiting may receive again
if clear_suspicion(K, g, m) then woke = true end
flush_journal(K)
if woke then redis.call('SPUBLISH', K.wake, 'nack') end
return {returned, dead, (delay > 0 and not discard and returned > dead) and now + delay or -1,
  requeued and redis.call('HGET', K.meta, 'push') or ''}
