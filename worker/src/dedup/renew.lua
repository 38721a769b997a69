-- Extends a claim's lease, counting a handler start that begins (+1) or
-- ended (-1), or only keeping it alive (0). Only the claim's owner renews it:
-- a claim taken over by a newer copy is never overwritten.
-- KEYS: order state, dedup key. ARGV: 1 seq ('' unsequenced), 2 claim token,
-- 3 epoch, 4 lease ms, 5 change of the unfinished starts, 6 evidence ms.
-- Returns the unfinished starts, or -1 when the claim is not ours.
local now = now_ms()
if ARGV[1] == '' then
  local v = redis.call('GET', KEYS[2])
  local n = 0
  if v then
    if token_of(v) ~= ARGV[2] then return -1 end
    n = tonumber(string.match(v, '^processing:%d+:(%d+):')) or 0
  end
  n = math.max(n + tonumber(ARGV[5]), 0)
  redis.call('SET', KEYS[2], 'processing:' .. (now + tonumber(ARGV[4])) .. ':' .. n .. ':' .. ARGV[2], 'PX', ARGV[6])
  return n
end
local c, f = unpack(redis.call('HMGET', KEYS[1], 'c', 'f'))
if stale(f, ARGV[3]) then return -1 end
local n = 0
if c then
  if token_of(c) ~= ARGV[2] then return -1 end
  n = tonumber(string.match(c, '^%d+:%d+:(%d+):')) or 0
end
n = math.max(n + tonumber(ARGV[5]), 0)
redis.call('HSET', KEYS[1], 'c', ARGV[1] .. ':' .. (now + tonumber(ARGV[4])) .. ':' .. n .. ':' .. ARGV[2] .. ':' .. ARGV[3])
return n
