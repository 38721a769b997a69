-- Helpers shared by the order-state scripts (prepended to each).
--
-- Seqs go up to 2^63-1, beyond a Lua number's precision, so they stay
-- decimal strings: compared by length then text, stepped by one digit-wise.
-- Epochs and times are below 2^53 and are numbers.

local function cmp(a, b)
  if #a ~= #b then return #a < #b and -1 or 1 end
  if a == b then return 0 end
  return a < b and -1 or 1
end

local function inc(s)
  local i = #s
  while i > 0 do
    local d = string.byte(s, i)
    if d < 57 then
      return string.sub(s, 1, i - 1) .. string.char(d + 1) .. string.rep('0', #s - i)
    end
    i = i - 1
  end
  return '1' .. string.rep('0', #s)
end

-- s - 1, for s >= 1.
local function dec(s)
  local i = #s
  while i > 0 do
    local d = string.byte(s, i)
    if d > 48 then
      local r = string.sub(s, 1, i - 1) .. string.char(d - 1) .. string.rep('9', #s - i)
      return (string.match(r, '^0*(%d.*)$'))
    end
    i = i - 1
  end
  return '0'
end

local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

-- The never-processed seqs at or below the gate, a field `u` of sorted,
-- disjoint, non-adjacent ranges: "1-4999,5003,5010-5012".
local function ranges(u)
  local out = {}
  if u then
    for item in string.gmatch(u, '[^,]+') do
      local lo, hi = string.match(item, '^(%d+)-(%d+)$')
      if lo then out[#out + 1] = {lo, hi} else out[#out + 1] = {item, item} end
    end
  end
  return out
end

local function unranges(list)
  local parts = {}
  for _, r in ipairs(list) do
    parts[#parts + 1] = (r[1] == r[2]) and r[1] or (r[1] .. '-' .. r[2])
  end
  return table.concat(parts, ',')
end

local function marked(u, s)
  for _, r in ipairs(ranges(u)) do
    if cmp(r[1], s) <= 0 and cmp(s, r[2]) <= 0 then return true end
  end
  return false
end

-- u with lo..hi added (merged with ranges it overlaps or touches).
local function mark(u, lo, hi)
  local out, placed = {}, false
  for _, r in ipairs(ranges(u)) do
    if placed or cmp(inc(r[2]), lo) < 0 then
      out[#out + 1] = r
    elseif cmp(inc(hi), r[1]) < 0 then
      out[#out + 1] = {lo, hi}
      out[#out + 1] = r
      placed = true
    else
      if cmp(r[1], lo) < 0 then lo = r[1] end
      if cmp(r[2], hi) > 0 then hi = r[2] end
    end
  end
  if not placed then out[#out + 1] = {lo, hi} end
  return unranges(out)
end

-- u without s.
local function unmark(u, s)
  local out = {}
  for _, r in ipairs(ranges(u)) do
    if cmp(r[1], s) <= 0 and cmp(s, r[2]) <= 0 then
      if cmp(r[1], s) < 0 then out[#out + 1] = {r[1], dec(s)} end
      if cmp(s, r[2]) < 0 then out[#out + 1] = {inc(s), r[2]} end
    else
      out[#out + 1] = r
    end
  end
  return unranges(out)
end

-- The gate moved to seq (never back); the seqs it skips are marked never
-- processed. Returns the new last seq and u.
local function advance(l, u, seq)
  if not l then
    if seq ~= '1' then u = mark(u, '1', dec(seq)) end
    return seq, u
  end
  if cmp(seq, l) <= 0 then return l, u end
  if cmp(dec(seq), l) > 0 then u = mark(u, inc(l), dec(seq)) end
  return seq, u
end

-- A write of a consumer older than the order's last writer.
local function stale(f, epoch)
  return f and tonumber(f) > tonumber(epoch)
end

-- The token of a claim "seq:deadline:starts:token:epoch" (or, for an
-- unsequenced event's key, "processing:deadline:starts:token").
local function token_of(claim)
  if not claim then return nil end
  return string.match(claim, '^[%w]+:%d+:%d+:(%d+)')
end

-- Writes u: the field goes when no seq is marked.
local function put_u(h, fields, u, had)
  if u and u ~= '' then
    fields[#fields + 1] = 'u'
    fields[#fields + 1] = u
  elseif had then
    redis.call('HDEL', h, 'u')
  end
end

-- Whether the kinds field holds a kind's code (8 characters each).
local function has_kind(k, code)
  if not k then return false end
  for i = 1, #k, 8 do
    if string.sub(k, i, i + 7) == code then return true end
  end
  return false
end
