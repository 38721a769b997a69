-- Gives a claim up, only if it is still this delivery's own (never a newer
-- copy's, never a `done` mark).
-- KEYS: order state, dedup key. ARGV: 1 seq ('' unsequenced), 2 claim token.
if ARGV[1] == '' then
  if token_of(redis.call('GET', KEYS[2])) == ARGV[2] then return redis.call('DEL', KEYS[2]) end
  return 0
end
if token_of(redis.call('HGET', KEYS[1], 'c')) == ARGV[2] then return redis.call('HDEL', KEYS[1], 'c') end
return 0
