-- lib/mailbox.lua: push mailboxes (bounded lists in Redis) and the graceful
-- max-N end. An entry is `tag NUL id NUL acquisitions NUL epoch NUL body`;
-- the end-of-stream sentinel is the entry 'EOS'. A message in a mailbox is
-- checked out to its member (record + ownership) but its lease starts only
-- when the member TAKEs it, so an unread mailbox never times out under it.
-- Helpers only: they use the including fence's K and the mailbox key it was
-- given in KEYS; they build no key names themselves.
--@include lib/members.lua
--@include lib/reading.lua

local EOS = 'EOS'

-- A mailbox entry: tag NUL id NUL acquisitions NUL epoch NUL body. What a first
-- delivery's entries share between id and body is made once per epoch per call
-- (two number formats per entry less: 5-6% of a mailbox fill, measured).
local FIRST_UNDER = {}  -- epoch -> NUL '1' NUL epoch NUL
local function mailbox_entry(t, ep)
  if t[3] == 1 then
    local mid = FIRST_UNDER[ep]
    if not mid then
      mid = SEP .. '1' .. SEP .. int_str(ep) .. SEP
      FIRST_UNDER[ep] = mid
    end
    return t[1] .. SEP .. (t[6] or int_str(t[2])) .. mid .. t[4]
  end
  return t[1] .. SEP .. (t[6] or int_str(t[2])) .. SEP .. int_str(t[3]) .. SEP .. int_str(ep) .. SEP .. t[4]
end

local function push_list_remove(meta, g, m)
  local list = redis.call('HGET', meta, 'push')
  if not list then return end
  local keep = {}
  for _, entry in ipairs(split(list, '\n')) do
    if entry ~= g .. '\t' .. m then keep[#keep + 1] = entry end
  end
  if #keep == 0 then redis.call('HDEL', meta, 'push') else redis.call('HSET', meta, 'push', table.concat(keep, '\n')) end
end

local function push_list_add(meta, g, m)
  local list = redis.call('HGET', meta, 'push')
  local entry = g .. '\t' .. m
  if not list then redis.call('HSET', meta, 'push', entry); return end
  for _, e in ipairs(split(list, '\n')) do if e == entry then return end end
  redis.call('HSET', meta, 'push', list .. '\n' .. entry)
end

-- Seat the end-of-stream sentinel by evict-offer: append if there is room,
-- else evict the oldest entry (its message goes back to the queue, not lost
-- to the subscription) and append. Never waits for the consumer.
-- why: 'max' (its MAX was reached: it stays to settle what it took) or
-- 'unsub' (it cancelled: everything went back, it leaves at the sentinel).
local function seat_sentinel(K, mb, g, m, cap, why)
  if redis.call('LLEN', mb) >= cap then
    local oldest = redis.call('LPOP', mb)
    if oldest and oldest ~= EOS then
      local c = take_checkout(K, string.match(oldest, '^([^%z]*)'))
      if c then requeue(K, c, c.fail) end
    end
  end
  redis.call('RPUSH', mb, EOS)
  redis.call('HSET', K.meta, mf(g, m, ENDED), why or 'max')
  journal(now_ms(), 'end', g, m)
  push_list_remove(K.meta, g, m)
end

-- Top the mailbox up to its capacity (and to MAX, seating the sentinel when
-- MAX is reached). Returns how many messages were dispatched.
local function fill_mailbox(K, mb, g, m, now)
  local status, ep, member, count = delivery_gate(K, g, m, 1000000)
  if not member.cap then return 0 end
  local cap = tonumber(member.cap)
  if status == 'ended' and not member.ended then
    seat_sentinel(K, mb, g, m, cap)
    return 0
  end
  if status ~= 'ok' then return 0 end
  local room = cap - redis.call('LLEN', mb)
  if room < count then count = room end
  -- a shared group's messages are handed out by its strategy (dispatch_group)
  if redis.call('HGET', K.meta, gf(g, MODE)) == 'shared' then count = 0 end
  local taken = {}
  if count > 0 then taken = check_out(K, g, m, count, ep, now, nil, member.qos) end
  if #taken > 0 then
    local entries = {}
    for i, t in ipairs(taken) do entries[i] = mailbox_entry(t, ep) end
    redis.call('RPUSH', mb, unpack(entries))
  end
  if member.max and member.delivered + #taken >= tonumber(member.max) then seat_sentinel(K, mb, g, m, cap) end
  return #taken
end


-- Take up to `count` deliveries from member m's mailbox. What the member may
-- not receive it does not get, whatever the QoS: a member fenced off by a
-- marker gets nothing (what it held goes back, its mailbox is emptied: QoS 0
-- entries are at most once), a suspected one nothing until it settles or
-- renews (yet EOS at the end of its stream: a suspected member after its
-- UNSUB or past the sentinel of its MAX, a fenced-off one after its UNSUB),
-- and entries read under an epoch older than the group's (a SEEK since) or
-- whose checkout was released are dropped. Each QoS 1 delivery's lease starts
-- now. Returns the deliveries {tag, id, acquisitions, body}, the group's
-- epoch, the leases' deadline (-1 when none) and a status: 'ok', 'evicted',
-- 'suspected', 'eos' when the end-of-stream sentinel of a MAX was reached (the
-- member stays, ended, so what it took can still be settled) or 'gone' at the
-- sentinel of an UNSUB (the member is removed); 'evicted' comes with whether
-- the member had polled since its eviction before (fenced_off).
-- Cost: O(entries popped + messages topped up).
local function take_from_mailbox(K, mb, g, m, count, now, default_lock)
  local f = read_meta(K.meta, {mf(g, m, DELIVERED), mf(g, m, CAPACITY), mf(g, m, LOCK), gf(g, EPOCH),
    mf(g, m, MARKER), mf(g, m, SUSPECTED), mf(g, m, ENDED), 'lock'})
  if not f[1] then raise('NOTFOUND', 'not subscribed to this queue any more; SUB again for a new handle') end
  if not f[2] then raise('BADARG', 'this is not a PUSH subscription; PULL instead of TAKE') end
  expand_meta(K.meta)  -- the writes below must not leave a field to a default
  local ep = tonumber(f[4] or '0')
  -- A marker or suspicion withholds messages, never the end of the stream: a
  -- member that cancelled (UNSUB) had every checkout returned and its mailbox
  -- emptied but for the sentinel, and one past the sentinel of its MAX gets
  -- nothing more. Else its TAKE answers nil for ever (a cancelled member never
  -- leaves) where it must answer EOS.
  local cancelled = f[7] == 'unsub'
  if f[5] and not cancelled then
    local polled_before = fenced_off(K, g, m, ep, f[5], true)
    redis.call('DEL', mb)
    return {}, ep, -1, 'evicted', polled_before
  end
  if f[6] and not cancelled then
    local head = f[7] and redis.call('LINDEX', mb, 0)
    if not (f[7] and (not head or head == EOS)) then return {}, ep, -1, 'suspected' end
  end
  local ended = f[7] and true or false  -- (a missing field is false, not nil)
  if not ended then fill_mailbox(K, mb, g, m, now) end
  local lock = tonumber(f[3] or f[8] or default_lock)
  local out, deadline, status = {}, -1, 'ok'
  local due_text = int_str(now + lock)  -- every lease started here ends then: made once
  local leased = {}  -- ZADD arguments: deadline, tag, ...
  local skipped, topped_up, at_end = false, false, false
  local expired_ids = {}
  -- Entries are popped, looked up and leased a chunk at a time (one LPOP, HMGET, ZMSCORE
  -- and ZADD per chunk, not per entry); each is judged as it was one by one.
  while #out < count and not at_end do
    local entries = redis.call('LPOP', mb, count - #out)
    if not entries and skipped and not topped_up and not ended then
      -- Everything left was released (a seek, a preemption): what is ready
      -- now may take the room it made.
      topped_up = true
      fill_mailbox(K, mb, g, m, now)
      entries = redis.call('LPOP', mb, count - #out)
    end
    if not entries then
      if redis.call('HEXISTS', K.meta, mf(g, m, ENDED)) == 1 then status = 'eos' end
      break
    end
    local parsed, tags = {}, {}
    for i, entry in ipairs(entries) do
      if entry ~= EOS then
        -- tag, id, acquisitions, epoch, and where the body starts: one match, no list of parts
        -- (splitting the entry's head was a quarter of a PULL from a mailbox, measured)
        local p = {string.match(entry, '^([^%z]*)%z([^%z]*)%z([^%z]*)%z([^%z]*)%z()')}
        parsed[i] = p
        -- at most once (a 'q' tag) has no lease to look up; an older epoch's entry is dropped
        if string.sub(p[1], 1, 1) ~= 'q' and tonumber(p[4]) >= ep then tags[#tags + 1] = p[1] end
      end
    end
    local held, dues = {}, {}
    if #tags > 0 then
      local recs = redis.call('HMGET', K.checkouts, unpack(tags))
      local scores = redis.call('ZMSCORE', K.deadlines, unpack(tags))
      for i, tag in ipairs(tags) do held[tag], dues[tag] = recs[i], scores[i] end
    end
    for i, entry in ipairs(entries) do
      if entry == EOS then
        -- A sentinel from before the member subscribed again is not its end.
        local why = redis.call('HGET', K.meta, mf(g, m, ENDED))
        if why then
          redis.call('DEL', mb)
          journal(now, 'eos', g, m)
          status = 'eos'
          if why == 'unsub' then
            -- a member that cancelled has nothing left to settle: it goes now
            remove_member(K, g, m)
            status = 'gone'
          else
            release_ownership(K, g, m)
          end
          at_end = true
          break
        end
      else
        local p = parsed[i]
        local tag = p[1]
        local qos0 = string.sub(tag, 1, 1) == 'q'  -- at most once: no lease to start
        local current = tonumber(p[4]) >= ep and (qos0 or held[tag])
        -- a leased entry past its deadline is the sweep's to take back, not the member's
        if current and not qos0 and dues[tag] and tonumber(dues[tag]) <= now then current = false end
        local body = current and string.sub(entry, p[5])
        if current and expired(body, now) then
          -- expired while it waited in the mailbox: settled without delivery, and counted
          if not qos0 then take_checkout(K, tag) end
          expired_ids[#expired_ids + 1] = tonumber(p[2])
          skipped = true
        elseif current then
          if not qos0 then
            leased[#leased + 1] = due_text
            leased[#leased + 1] = tag
          end
          out[#out + 1] = {tag, tonumber(p[2]), tonumber(p[3]), body}
        else
          skipped = true
        end
      end
    end
  end
  count_expired(K, g, expired_ids, now)
  if #leased > 0 then
    deadline = now + lock
    redis.call('ZADD', K.deadlines, unpack(leased))
  end
  if #out > 0 and status == 'ok' then fill_mailbox(K, mb, g, m, now) end
  return out, ep, deadline, status
end
