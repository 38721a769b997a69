-- Commits one event and admits the next sequenced one in one script call
-- (`commit.lua`, then `admit_order.lua`): one round trip and one script run
-- per event on the usual path.
-- KEYS: the commit's four, then the admit's three. ARGV: the commit's seven,
-- then the admit's thirteen. Returns {written, verdict, starts}.
local written = commit({KEYS[1], KEYS[2], KEYS[3], KEYS[4]}, {unpack(ARGV, 1, 7)})
local answer = admit_order({KEYS[5], KEYS[6], KEYS[7]}, {unpack(ARGV, 8, 20)})
return {written, answer[1], answer[2]}
