-- After an event's dead letter is confirmed: its claim goes (only its own),
-- its seq counts as passed but stays marked never processed (so that its
-- replay runs), a replay's record is spent, and in quarantine mode the
-- letter holds its order.
-- The letter's dead-letter index entry is written first, fenced or not: the
-- letter is in the DLQ whoever owns the order now.
-- KEYS: order state, dedup key, quarantine, then the index's five
-- (`IndexEntry::script_keys`), then the replay's record.
-- ARGV: 1 seq ('' unsequenced), 2 claim token, 3 epoch, 4 era,
-- 5 ttl s, 6 letter id ('' when not quarantining), 7 replayed dead-letter id
-- (''), 8 the letter's quarantine score, 9.. the index entry
-- (`IndexEntry::script_args`).
-- Returns 0 when fenced: nothing but the index entry written (a newer
-- consumer owns the order; a quarantine lifted meanwhile stays lifted).
index_letter({KEYS[4], KEYS[5], KEYS[6], KEYS[7], KEYS[8]}, {unpack(ARGV, 9)})
local h, seq = KEYS[1], ARGV[1]
if seq == '' then
  if stale(redis.call('HGET', h, 'f'), ARGV[3]) then return 0 end
  if token_of(redis.call('GET', KEYS[2])) == ARGV[2] then redis.call('DEL', KEYS[2]) end
else
  local l, u, c, f = unpack(redis.call('HMGET', h, 'l', 'u', 'c', 'f'))
  if stale(f, ARGV[3]) then return 0 end
  local had = u
  if token_of(c) == ARGV[2] then redis.call('HDEL', h, 'c') end
  l, u = advance(l, u, seq)
  u = mark(u, seq, seq)
  local fields = {'l', l, 'f', ARGV[3], 'e', ARGV[4]}
  put_u(h, fields, u, had)
  redis.call('HSET', h, unpack(fields))
  redis.call('EXPIRE', h, ARGV[5])
end
if ARGV[7] ~= '' then redis.call('DEL', KEYS[9]) end
if ARGV[6] ~= '' then
  if ARGV[7] ~= '' then redis.call('ZREM', KEYS[3], ARGV[7]) end
  redis.call('ZADD', KEYS[3], ARGV[8], ARGV[6])
end
return 1
