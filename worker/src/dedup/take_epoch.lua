-- Takes the next epoch of the fleet for a consumer of a shard: the fleet's
-- counter, raised first above the shard's own record (a worker of an earlier
-- release counted epochs per shard there), and recorded as the shard's newest.
-- An epoch taken anywhere is above every epoch taken before it, on any shard:
-- a consumer that takes moved keys outranks every writer they had.
-- KEYS: 1 the fleet's epoch counter, 2 the shard's newest epoch.
local epoch = redis.call('INCR', KEYS[1])
local shard = tonumber(redis.call('GET', KEYS[2]) or '0') or 0
if shard >= epoch then
  epoch = shard + 1
  redis.call('SET', KEYS[1], epoch)
end
redis.call('SET', KEYS[2], epoch)
return epoch
