-- retain.lua: keep a topic's retained message (the last one published with RETAIN).
--@include lib/shared.lua
--@flags none
--
-- KEYS[1] retained        hash: topic -> its retained message (stored form)
-- KEYS[2] topics          zset (lex): every topic with a retained message
-- KEYS[3] levels          zset (lex): the trie of their levels (lib/shared.lua retained_edges)
-- KEYS[4] indexed         set once every retained topic is indexed: by the first message kept,
--                         or by fences/retained.py once it indexed those of an older version
-- ARGV[1] topic
-- ARGV[2] body            the message in its stored form (non-empty); '' with reindex
-- ARGV[3] reindex         1: only index the topic, if it has a retained message (one
--                         kept before the index existed); 0: keep the body
-- Returns: 1 when the topic was not indexed before, else 0.
-- Errors: BADARG when the body is empty (an empty payload clears: unretain.lua)
--   or reindex is not 0 or 1.
-- Cost: O(levels · log n).
local reindex = int_arg(A.reindex, 'reindex', 0, 1)
if reindex == 0 and A.body == '' then
  raise('BADARG', 'an empty retained message clears the topic; unretain it')
end
if redis.call('EXISTS', K.retained) == 0 then redis.call('SET', K.indexed, 1) end
local new
if reindex == 1 then
  if redis.call('HEXISTS', K.retained, A.topic) == 0 then return 0 end
  new = redis.call('ZADD', K.topics, 0, A.topic)
else
  new = redis.call('HSET', K.retained, A.topic, A.body)
  if new == 1 then redis.call('ZADD', K.topics, 0, A.topic) end
end
if new == 1 then
  local edges = retained_edges(A.topic)
  for _, edge in ipairs(edges) do redis.call('ZADD', K.levels, 0, edge) end
end
return new
