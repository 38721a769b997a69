-- Commits a processed event: the gate moves to its seq (never back; skipped
-- seqs are marked never processed) or, for a replayed seq at or below it, the
-- seq's mark is cleared; its kind is recorded; its claim goes (only its own);
-- a replay leaves its order's quarantine and spends its replay record.
-- KEYS: order state, dedup key, quarantine, the replay's record.
-- ARGV: 1 seq ('' unsequenced), 2 claim token, 3 epoch, 4 era, 5 ttl s,
-- 6 kind code ('' when kinds are not recorded), 7 replayed dead-letter id ('').
-- Returns 0 when fenced (a newer consumer wrote the order): nothing written.
local function commit(KEYS, ARGV)
  local h, seq = KEYS[1], ARGV[1]
  local fields = {'f', ARGV[3]}
  local k
  if seq == '' then
    local f
    f, k = unpack(redis.call('HMGET', h, 'f', 'k'))
    if stale(f, ARGV[3]) then return 0 end
    redis.call('SET', KEYS[2], 'done', 'EX', ARGV[5])
  else
    local l, u, c, f, m
    l, u, c, f, m, k = unpack(redis.call('HMGET', h, 'l', 'u', 'c', 'f', 'm', 'k'))
    if stale(f, ARGV[3]) then return 0 end
    local had = u
    if l and cmp(seq, l) <= 0 then
      if m and cmp(seq, m) <= 0 then
        redis.call('SET', KEYS[2], 'done', 'EX', ARGV[5])
      else
        u = unmark(u, seq)
      end
    else
      l, u = advance(l, u, seq)
    end
    if token_of(c) == ARGV[2] then redis.call('HDEL', h, 'c') end
    fields[#fields + 1] = 'l'
    fields[#fields + 1] = l
    fields[#fields + 1] = 'e'
    fields[#fields + 1] = ARGV[4]
    put_u(h, fields, u, had)
  end
  if ARGV[6] ~= '' and not has_kind(k, ARGV[6]) then
    fields[#fields + 1] = 'k'
    fields[#fields + 1] = (k or '') .. ARGV[6]
  end
  redis.call('HSET', h, unpack(fields))
  redis.call('EXPIRE', h, ARGV[5])
  if ARGV[7] ~= '' then
    redis.call('ZREM', KEYS[3], ARGV[7])
    redis.call('DEL', KEYS[4])
  end
  return 1
end
