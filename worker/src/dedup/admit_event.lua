-- Admits an unsequenced event: its own key holds its claim or `done`.
-- KEYS: dedup key. ARGV: 1 lease ms, 2 redelivered, 3 max starts,
-- 4 evidence ms, 5 claim token.
local v = redis.call('GET', KEYS[1])
if v == 'done' then return {'duplicate', 0} end
local now = now_ms()
local starts, verdict = 1, 'claimed'
if v then
  local deadline, n, token = string.match(v, '^processing:(%d+):(%d+):(%d*)')
  deadline = tonumber(deadline) or 0
  n = tonumber(n) or 1
  if token == ARGV[5] then return {'claimed', n} end
  if ARGV[2] ~= '1' and deadline > now then return {'wait', deadline - now} end
  if n >= tonumber(ARGV[3]) then return {'crashloop', n} end
  starts, verdict = n + 1, 'takeover'
end
redis.call('SET', KEYS[1], 'processing:' .. (now + tonumber(ARGV[1])) .. ':' .. starts .. ':' .. ARGV[5], 'PX', ARGV[4])
return {verdict, starts}
