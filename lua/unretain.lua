-- unretain.lua: clear a topic's retained message (a RETAIN publish with an empty payload).
--@include lib/shared.lua
--@flags allow-oom
--
-- KEYS[1] retained        hash: topic -> its retained message (stored form)
-- KEYS[2] topics          zset (lex): every topic with a retained message
-- KEYS[3] levels          zset (lex): the trie of their levels (lib/shared.lua retained_edges)
-- ARGV[1] topic
-- Returns: 1 when the topic had a retained message, else 0.
-- The trie keeps an edge while a retained topic is at or under the path it
-- leads to: the topic's own edges go from the deepest up, until one still
-- leads somewhere.
-- Errors: none of its own.
-- Cost: O(levels · log n).
if redis.call('HDEL', K.retained, A.topic) == 0 then return 0 end
redis.call('ZREM', K.topics, A.topic)
local edges, nodes = retained_edges(A.topic)
for i = #edges, 1, -1 do
  local path = nodes[i]
  local under = redis.call('ZRANGEBYLEX', K.topics, '[' .. path .. '/', '(' .. path .. '0', 'LIMIT', 0, 1)
  if #under > 0 or redis.call('ZSCORE', K.topics, path) then break end
  redis.call('ZREM', K.levels, edges[i])
end
return 1
