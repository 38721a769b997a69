-- Admits a sequenced event: decides by the order's state whether it may run
-- and, if so, claims it (the order's one claim: its events run one at a time).
-- KEYS: order state, legacy gate, legacy dedup key (both read only for an
-- order not yet in the order state, see `upgrade`).
-- ARGV: 1 seq, 2 lease ms, 3 redelivered, 4 bypass the gate, 5 a replay,
-- 6 max starts, 7 claim token, 8 epoch, 9 era, 10 ttl s, 11 kind code,
-- 12 kinds recorded, 13 the worker's clock (ms).
local function admit_order(KEYS, ARGV)
  local h = KEYS[1]
  local l, u, c, f, e, m, k = unpack(redis.call('HMGET', h, 'l', 'u', 'c', 'f', 'e', 'm', 'k'))
  local seq, epoch = ARGV[1], ARGV[8]
  local fresh = not (l or u or c or f or e or m or k)
  if stale(f, epoch) then return {'fenced', 0} end
  local migrated = false
  if not l then
    local g = redis.call('GET', KEYS[2])
    if g then l, m, migrated = g, g, true end
  end
  if l and cmp(seq, l) <= 0 then
    local never
    if m and cmp(seq, m) <= 0 then
      never = redis.call('GET', KEYS[3]) ~= 'done'
    else
      never = marked(u, seq) or (ARGV[12] == '1' and not has_kind(k, ARGV[11]))
    end
    if not never then return {'duplicate', 0} end
    -- Never processed: only a replay runs it; a fresh copy came too late.
    if ARGV[5] ~= '1' then return {'late', 0} end
  elseif ARGV[4] ~= '1' then
    if not l then
      if seq ~= '1' then return {'start', 0} end
    elseif cmp(dec(seq), l) > 0 then
      -- State written before a Redis failover may have lost its last seqs:
      -- such a gap waits the start grace, not the gap grace.
      if e and e ~= ARGV[9] then return {'start', 0} end
      return {'gap', 0}
    end
  end
  local now = tonumber(ARGV[13])
  local starts, verdict = 1, 'claimed'
  if c then
    local cseq, deadline, n, token = string.match(c, '^(%d+):(%d+):(%d+):(%d+):')
    if cseq == seq then
      n = tonumber(n)
      if token == ARGV[7] then return {'claimed', n} end
      deadline = tonumber(deadline)
      if ARGV[3] ~= '1' and deadline > now then return {'wait', deadline - now} end
      if n >= tonumber(ARGV[6]) then return {'crashloop', n} end
      starts, verdict = n + 1, 'takeover'
    end
  end
  local claim = seq .. ':' .. (now + tonumber(ARGV[2])) .. ':' .. starts .. ':' .. ARGV[7] .. ':' .. epoch
  if migrated then
    redis.call('HSET', h, 'c', claim, 'f', epoch, 'e', ARGV[9], 'l', l, 'm', m)
  else
    redis.call('HSET', h, 'c', claim, 'f', epoch, 'e', ARGV[9])
  end
  -- A new order's key needs its TTL now (the commit refreshes it after).
  if fresh then redis.call('EXPIRE', h, ARGV[10]) end
  return {verdict, starts}
end
