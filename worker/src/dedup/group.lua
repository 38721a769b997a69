-- Group commit (`--group-commit`): commits the processed events of one group,
-- then admits the events of the next, in one script call.
-- KEYS: four per commit (`commit.lua`'s), then three per admit
-- (`admit_order.lua`'s). ARGV: 1 commits, 2 admits; then per commit its seven
-- arguments; then per admit a chained flag and its thirteen.
-- A chained admit is the next seq of an order whose earlier event is admitted
-- in the same group: it runs right after that one, under the order's one
-- claim (its predecessor's), so it is claimed without a write; its commit
-- moves the gate on from its predecessor's.
-- Commits stop at the first fenced one (nothing is admitted then); admits stop
-- at the first that is not claimed. Returns {commits written, fenced (1 or
-- 0), {{verdict, starts}, ...}}.
local nc, na = tonumber(ARGV[1]), tonumber(ARGV[2])
for i = 1, nc do
  local k, a = 4 * (i - 1), 2 + 7 * (i - 1)
  if commit({KEYS[k + 1], KEYS[k + 2], KEYS[k + 3], KEYS[k + 4]}, {unpack(ARGV, a + 1, a + 7)}) == 0 then
    return {i - 1, 1, {}}
  end
end
local verdicts = {}
for i = 1, na do
  local k, a = 4 * nc + 3 * (i - 1), 2 + 7 * nc + 14 * (i - 1)
  local answer
  if ARGV[a + 1] == '1' then
    answer = {'claimed', 1}
  else
    answer = admit_order({KEYS[k + 1], KEYS[k + 2], KEYS[k + 3]}, {unpack(ARGV, a + 2, a + 14)})
  end
  verdicts[i] = answer
  if answer[1] ~= 'claimed' then break end
end
return {nc, 0, verdicts}
