-- lib/leases.lua: making leases (lease_out: checkouts, one batch per PULL),
-- the ready and delayed sets, what a member or a group holds, and when a
-- queue is next due. A checkout's record, its batch and the holding index
-- are lib/checkouts.lua's.
--@include lib/checkouts.lua
--@include lib/meta.lua
--@include lib/journal.lua
--@include lib/totals.lua
--@include lib/priority.lua
--@include lib/expiry.lua
--
-- Encodings (docs/data-model.md; broker/model/records.py reads them):
--   ready member     group NUL id(16 digits) NUL acquisitions NUL failures

local function ready_member(g, id, acq, fail)
  return g .. SEP .. pad(id) .. SEP .. int_str(acq) .. SEP .. int_str(fail)
end

-- Put a returned message back where it was in id order, ahead of newer ones.
local function requeue(K, c, fail)
  add_total(K, READY, redis.call('ZADD', K.ready, 0, ready_member(c.group, c.id, c.acq, fail)))
end

-- Tags a member holds, in O(its own checkouts).
local function member_tags(K, g, m)
  local prefix = g .. SEP .. m .. SEP
  local owned = redis.call('ZRANGEBYLEX', K.owned, '[' .. prefix, '(' .. g .. SEP .. m .. '\1')
  local leases = {}
  for i, member in ipairs(owned) do leases[i] = string.sub(member, #prefix + 1) end
  return tags_of_leases(K, leases)
end

-- How many checkouts group g's members hold. O(the group's leases).
local function group_checkout_count(K, g)
  local owned = redis.call('ZRANGEBYLEX', K.owned, '[' .. g .. SEP, '(' .. g .. '\1')
  local n = 0
  for _, member in ipairs(owned) do
    local key = string.match(member, '%z(b%d+%+%d+)$')
    n = n + (key and tonumber(redis.call('HGET', K.checkouts, key) or '0') or 1)
  end
  return n
end

local function return_member_checkouts(K, g, m)
  local tags = member_tags(K, g, m)
  for _, tag in ipairs(tags) do
    local c = take_checkout(K, tag)
    if c then requeue(K, c, c.fail) end
  end
  return tags
end

-- Every checkout of a group (all members): requeued, or released for good.
-- Cost: O(the group's checkouts).
local function release_group_checkouts(K, g, back_to_ready)
  local owned = redis.call('ZRANGEBYLEX', K.owned, '[' .. g .. SEP, '(' .. g .. '\1')
  local leases = {}
  for i, member in ipairs(owned) do leases[i] = split(member, SEP)[3] end
  local tags = tags_of_leases(K, leases)
  for _, tag in ipairs(tags) do
    local c = take_checkout(K, tag)
    if c and back_to_ready then requeue(K, c, c.fail) end
  end
  return #tags
end

local function promote_delayed(K, now)
  local due = redis.call('ZRANGEBYSCORE', K.delayed, '-inf', now, 'LIMIT', 0, 1000)
  if #due > 0 then
    local added = 0
    for _, member in ipairs(due) do added = added + redis.call('ZADD', K.ready, 0, member) end
    add_total(K, READY, added)
    add_total(K, DELAYED, -redis.call('ZREM', K.delayed, unpack(due)))
  end
  return #due
end

-- Earliest moment something in this queue is due (a lease deadline, a
-- delayed redelivery or a scheduled message), or -1: the worker keeps the global schedule with it.
local function next_due(K)
  local best = -1
  local d = redis.call('ZRANGE', K.deadlines, 0, 0, 'WITHSCORES')
  if d[2] then best = tonumber(d[2]) end
  local l = redis.call('ZRANGE', K.delayed, 0, 0, 'WITHSCORES')
  if l[2] and (best < 0 or tonumber(l[2]) < best) then best = tonumber(l[2]) end
  if K.scheduled then  -- messages published for later (lib/schedule.lua): swept on the same schedule
    local s = redis.call('ZRANGE', K.scheduled, 0, 0, 'WITHSCORES')
    if s[2] and (best < 0 or tonumber(s[2]) < best) then best = tonumber(s[2]) end
  end
  return best
end

-- A consumer that settles or renews is no longer suspected. In single-active
-- mode it takes over when the active member is gone or suspected itself, so a
-- group whose members all timed out never deadlocks.
-- Returns true when the member was suspected: a long poll it has waiting
-- may receive again (the caller wakes the queue's channel).
local function clear_suspicion(K, g, m)
  if redis.call('HDEL', K.meta, mf(g, m, SUSPECTED), mf(g, m, TIMED_OUT)) == 0 then return false end
  tally(K, 'suspected', -1)
  return true
end

-- A fence that makes leases runs under a lease intent that listed its queue
-- in the schedule (lua/lease_intent.lua) at most intent_ms before: else
-- STALE, nothing done, and the worker writes a fresh intent. Checked first.
local function check_intent(intent_at, intent_ms)
  local at, limit = int_arg(intent_at, 'lease intent'), int_arg(intent_ms, 'lease intent ms')
  if now_ms() - at > limit then
    raise('STALE', 'the lease intent of this call is older than ' .. int_str(limit) .. ' ms; write a new one and retry')
  end
end

-- Reserve n delivery tags; returns the last. A tag is never handed out twice
-- under one handle, even when its queue is dropped and created again (a
-- filter queue whose last member left, a reclaimed lmq): the counter never
-- falls behind Redis's clock in microseconds, and a queue hands out far fewer
-- than a million tags a second, so a new incarnation starts above every tag
-- of the old one. (2^53 microseconds since 1970 is in the year 2255.)
local function next_tags(meta, n)
  local t = redis.call('TIME')
  local clock = tonumber(t[1]) * 1000000 + tonumber(t[2])
  local top = tonumber(redis.call('HGET', meta, 'tag') or '0')
  if top < clock then top = clock end
  top = top + n
  redis.call('HSET', meta, 'tag', int_str(top))
  return top
end

-- Check `taken` (from take_next) out to member m: each message gets a fresh
-- tag and a record. `as_batch` with a `deadline` (a PULL's): the messages
-- share one lease (a lease batch: one deadline and one ownership entry); else
-- each has its own, with no deadline when none is given (a push mailbox
-- starts the lease when the consumer TAKEs it, one by one).
-- Granted QoS is min(member's, message's): a QoS 0 delivery is at most once —
-- no record, no lease, never redelivered — and its tag starts with 'q'.
-- Fills in each entry's tag and returns `taken`. O(#taken); what the batch
-- shares (epoch, time, the record's tail for a first delivery, the journal
-- entry) is built once per call.
local function lease_out(K, g, m, taken, ep, now, deadline, member_qos, as_batch)
  local n_taken = #taken
  if n_taken == 0 then return taken end

  local base = next_tags(K.meta, n_taken) - n_taken
  redis.call('HINCRBY', K.meta, mf(g, m, DELIVERED), n_taken)
  tally(K, 'delivered', n_taken)
  local tags = int_strs(base + 1, n_taken)
  local ep_text = SEP .. int_str(ep) .. SEP
  local first_tail = ep_text .. '1' .. SEP .. '0'  -- a first delivery: one acquisition, no failure
  local records, deadlines, owned, held, n = {}, {}, {}, {}, 0
  local lowest, prev, rising = nil, nil, true  -- a batch's first id; whether its ids rise with its tags
  -- a lease batch spans the call's tags (a QoS 0 one among them has no record)
  local batch = as_batch and deadline and n_taken > 1 and member_qos ~= 0 and batch_key(base + 1, n_taken - 1)
  local batch_tail = batch and SEP .. batch
  -- redis.call turns every number argument into text: the batch's one
  -- deadline (and the owned entries' score) go as text made once.
  local due = deadline and int_str(deadline)
  local journaling = journal_on(K)
  local marks = journaling and {} or nil
  local gm = g .. SEP .. m .. SEP
  local again = 0  -- redeliveries: a second acquisition or more
  for i = 1, n_taken do
    local t, tag = taken[i], tags[i]
    local body = t[4]
    if t[3] > 1 then again = again + 1 end
    if member_qos == 0 or string.byte(body, string.find(body, ':', 1, true) + 1) == 48 then  -- '0': QoS 0
      t[1] = 'q' .. tag
      if marks then marks[i] = 'q' end
    else
      t[1] = tag
      if marks then marks[i] = '' end
      n = n + 2
      records[n - 1] = tag
      if t[3] == 1 and t[5] == 0 then records[n] = gm .. t[6] .. first_tail
      else records[n] = gm .. t[6] .. ep_text .. int_str(t[3]) .. SEP .. int_str(t[5]) end
      if batch then
        records[n] = records[n] .. batch_tail
        if not lowest then lowest = t[2]
        elseif t[2] <= prev then rising = false end
        prev = t[2]
      else
        deadlines[n - 1] = due
        deadlines[n] = tag
        owned[n - 1] = '0'
        owned[n] = gm .. tag
      end
      held[n - 1] = t[6]
      held[n] = tag
    end
  end
  if journaling then
    local ids = {}
    for i = 1, n_taken do ids[i] = taken[i][2] end
    if again == 0 and n == 2 * n_taken then
      -- the usual call: every tag QoS 1 (one run) and every delivery a first: written as journal_batch
      -- would write them, without the per-message lists it reads them from
      local one = n_taken == 1
      journal_batch_text(now, 'out', g, m, journal_runs(ids),
        one and tags[1] or (tags[1] .. '-' .. tags[n_taken]), ep,
        one and '1' or ('1*' .. int_str(n_taken)))
    else
      local tag_nums, acqs = {}, {}
      for i = 1, n_taken do tag_nums[i], acqs[i] = base + i, taken[i][3] end
      journal_batch(now, 'out', g, m, ids, tag_nums, marks, ep, acqs)
    end
  end
  tally(K, 'redelivered', again)
  if n == 0 then return taken end
  add_total(K, OUT, n / 2)
  if batch then
    records[n + 1] = batch
    records[n + 2] = int_str(n / 2)
    redis.call('HSET', K.checkouts, unpack(records))
    redis.call('ZADD', K.deadlines, due, batch)
    redis.call('ZADD', K.owned, 0, gm .. batch)
    if rising then redis.call('ZADD', K.held, int_str(lowest), batch)
    else redis.call('ZADD', K.held, unpack(held)) end
  else
    redis.call('HSET', K.checkouts, unpack(records))
    if deadline then redis.call('ZADD', K.deadlines, unpack(deadlines)) end
    redis.call('ZADD', K.owned, unpack(owned))
    redis.call('ZADD', K.held, unpack(held))
  end
  return taken
end

local function lock_of(K, member, default)
  return tonumber(member.lock or redis.call('HGET', K.meta, 'lock') or default)
end

