-- ack.lua: settle checkouts of one member.
--@include _common.lua
-- (every fence: KEYS[last] is the queue's journal)
--
-- KEYS[1] meta  KEYS[2] checkouts  KEYS[3] deadlines  KEYS[4] owned
-- KEYS[5] ready  KEYS[6] delayed
-- ARGV[1] group  ARGV[2] member  ARGV[3] idle TTL ms of an lmq (0 = plain)
-- ARGV[4..] delivery tags
-- Returns: the number of checkouts settled. A tag that is not (any more)
--   checked out to this member — expired, redelivered, released by a seek,
--   settled before — settles nothing.
-- Cost: O(tags).
local K = {meta = KEYS[1], co = KEYS[2], dl = KEYS[3], own = KEYS[4], rd = KEYS[5], dly = KEYS[6], jr = KEYS[#KEYS]}
local g, m = ARGV[1], ARGV[2]
local settled = 0
for i = 4, #ARGV do
  local rec = redis.call('HGET', K.co, ARGV[i])
  if rec then
    local c = parse_checkout(ARGV[i], rec)
    if c.group == g and c.member == m then
      take_checkout(K, ARGV[i])
      journal(now_ms(), 'ack', g, m, c.id, c.tag, c.epoch)
      settled = settled + 1
    end
  end
end
if settled > 0 then
  clear_suspicion(K.meta, g, m)
  reclaim_if_idle(K, tonumber(ARGV[3]))
  flush_journal(K)
end
return settled
