"""The prefix index's Lua scripts and the key prefixes and limits they run with.

Role: the Redis side of `router.routing.prefix_index` (which documents what a lookup answers
and its invariants): `LOOKUP_SCRIPT` matches a prompt's block hashes against the live engines
(all of them, or a large fleet's candidates), `MARK_PENDING_SCRIPT` writes a decision's pending
entries. Each script's arguments are listed above it.

Invariants: the scripts touch only keys of `kvfleet.contracts.redis_schema`; block hashes
travel as one argument of fixed-width entries, sliced inside the script (per-argument
encoding in redis-py was a third of a decision's router CPU with a 6,000-token prompt's 374
hashes, benchmarks/fleet_sim/decision_cost.py).
"""

from __future__ import annotations

from kvfleet.contracts import redis_schema

ENGINE_KEY_PREFIX = redis_schema.engine_key("")
# blocks_key(id, epoch) == BLOCKS_KEY_PREFIX + id + ":" + epoch (checked by the tests).
BLOCKS_KEY_PREFIX = redis_schema.blocks_key("", "").removesuffix(":")
HOST_BLOCKS_KEY_PREFIX = redis_schema.host_blocks_key("", "").removesuffix(":")
PENDING_KEY_PREFIX = redis_schema.pending_key("", "").removesuffix(":")
# Blocks checked per SMISMEMBER call inside the script, at most: the first call checks one
# block, each next one 4x more (1, 4, 16, 64, 64...), so an engine that lacks the prompt's
# first block (most of a large fleet: the chain is salted per tenant) costs one lookup, not 64.
MATCH_CHUNK = 64
# Separates an engine's id, counts, field names and values in the script's answer: one string
# per engine parses in C (str.split); ~45 RESP elements per engine cost ~4 ms of pure-Python
# parsing per decision at 64 engines. No registry field holds a NUL (JSON escapes it).
RECORD_SEP = "\0"
# Separates the answer's mode and its engines' strings: the whole answer is one bulk string, as
# each further RESP element is a few Python-level reads in redis-py. No registry field holds
# it either (a control character; JSON escapes it).
ANSWER_SEP = "\x1e"
# Pending entries per ZADD call inside the mark script (bounded Lua stacks).
MARK_CHUNK = 500
# Engines whose queued work (`kvfleet:load`) is within this of the least loaded one's count
# as about as idle when a large fleet's lookup picks its window of candidates (the same
# tolerance as the ranking's ties, router.routing.ttft_cost).
WINDOW_REL = 0.2
WINDOW_ABS_S = 0.01
HOLDERS_KEY_PREFIX = redis_schema.holders_key(b"")
HOST_HOLDERS_KEY_PREFIX = redis_schema.host_holders_key(b"")
PENDING_HOLDERS_KEY_PREFIX = redis_schema.pending_holders_key(b"")

# KEYS[1] = engines set, KEYS[2] = load ZSET; ARGV = engine key prefix, blocks key prefix,
# block size, chunk, max heartbeat age in seconds (0: no bound), host blocks key prefix,
# pending key prefix, full-scan fleet size, candidate window, window seed, holders key
# prefix, host holders key prefix, pending holders key prefix, hash width, the hashes
# concatenated (the script slices those it matches).
# The answer: one string, `ANSWER_SEP`-joined: "full" (every live engine) or "candidates",
# then one string per engine.
LOOKUP_SCRIPT = """
local engine_prefix, blocks_prefix = ARGV[1], ARGV[2]
local block_size, chunk = tonumber(ARGV[3]), tonumber(ARGV[4])
local max_age = tonumber(ARGV[5])
local host_prefix, pending_prefix = ARGV[6], ARGV[7]
local full_max, window, seed = tonumber(ARGV[8]), tonumber(ARGV[9]), tonumber(ARGV[10])
local holders_prefix, host_holders_prefix = ARGV[11], ARGV[12]
local pending_holders_prefix = ARGV[13]
local width, blob = tonumber(ARGV[14]), ARGV[15]
local first_hash, last_hash = 1, #blob / width
local SEP = '\0'
local time = redis.call('TIME')
local now = tonumber(time[1]) + tonumber(time[2]) / 1000000
local result, gone = {}, {}

-- The prompt's hashes i..j, each sliced from the blob once (most engines need only the first).
local sliced = {}
local function hashes(i, j)
  local out = {}
  for k = i, j do
    local h = sliced[k]
    if not h then
      h = string.sub(blob, (k - 1) * width + 1, k * width)
      sliced[k] = h
    end
    out[k - i + 1] = h
  end
  return out
end

local function match(id, info)
  local matched, host_matched, pending_matched, cached = 0, 0, 0, 0
  if not info['epoch'] then return matched, cached, host_matched, pending_matched end
  local suffix = id .. ':' .. info['epoch']
  local bkey, hkey = blocks_prefix .. suffix, host_prefix .. suffix
  local pkey = pending_prefix .. suffix
  cached = redis.call('SCARD', bkey)
  local host_cached = redis.call('SCARD', hkey)
  local pending = redis.call('ZCARD', pkey)
  if cached + host_cached + pending > 0 and tonumber(info['block_size']) == block_size then
    local i, done, step = first_hash, false, 1
    while i <= last_hash and not done do
      local j = math.min(i + step - 1, last_hash)
      step = math.min(step * 4, chunk)
      local hits, host_hits, expiry = {}, {}, {}
      local span = hashes(i, j)
      if cached > 0 then hits = redis.call('SMISMEMBER', bkey, unpack(span)) end
      if host_cached > 0 then host_hits = redis.call('SMISMEMBER', hkey, unpack(span)) end
      if pending > 0 then expiry = redis.call('ZMSCORE', pkey, unpack(span)) end
      for k = 1, j - i + 1 do
        if hits[k] == 1 then matched = matched + 1
        elseif host_hits[k] == 1 then host_matched = host_matched + 1
        elseif expiry[k] and tonumber(expiry[k]) > now then
          pending_matched = pending_matched + 1
        else done = true; break end
      end
      i = j + 1
    end
  end
  return matched, cached, host_matched, pending_matched
end

local function probe(id)
  local fields = redis.call('HGETALL', engine_prefix .. id)
  if #fields == 0 then table.insert(gone, id); return false end
  local info = {}
  for i = 1, #fields, 2 do info[fields[i]] = fields[i + 1] end
  local updated = tonumber(info['updated_at'])
  if max_age > 0 and updated ~= nil and now - updated > max_age then return false end
  local matched, cached, host_matched, pending_matched = match(id, info)
  table.insert(result, table.concat({id, matched, cached, host_matched, pending_matched,
                                     table.concat(fields, SEP)}, SEP))
  return true
end

local function append(ids, more)
  for _, id in ipairs(more) do table.insert(ids, id) end
end

-- The least loaded engines in the order the window takes them: those about as idle as the
-- least loaded one from an offset chosen by the seed (so new prefixes spread over an idle
-- fleet and every replica takes the same slice), then the rest of them, then the busier.
-- Up to 4 windows' worth: dead or stale members are passed over, not counted.
local function least_loaded()
  local want = window * 4
  local first = redis.call('ZRANGE', KEYS[2], 0, 0, 'WITHSCORES')
  if #first == 0 then return {} end
  local bound = tonumber(first[2]) * (1 + WINDOW_REL) + WINDOW_ABS_S
  local near = redis.call('ZCOUNT', KEYS[2], '-inf', bound)
  local offset = 0
  if near > window then offset = seed % near end
  local ids = redis.call('ZRANGE', KEYS[2], offset, math.min(near, offset + want) - 1)
  if offset > 0 then append(ids, redis.call('ZRANGE', KEYS[2], 0, offset - 1)) end
  if #ids < want then append(ids, redis.call('ZRANGE', KEYS[2], near, near + want - #ids - 1)) end
  return ids
end

local mode = 'full'
if last_hash < first_hash or redis.call('SCARD', KEYS[1]) <= full_max then
  for _, id in ipairs(redis.call('SMEMBERS', KEYS[1])) do probe(id) end
else
  mode = 'candidates'
  local h0 = hashes(1, 1)[1]
  local seen = {}
  local function consider(ids, limit)
    local added = 0
    for _, id in ipairs(ids) do
      if added >= limit then break end
      if not seen[id] then
        seen[id] = true
        if probe(id) then added = added + 1 end
      end
    end
  end
  local all = math.huge
  consider(redis.call('SMEMBERS', holders_prefix .. h0), all)
  consider(redis.call('SMEMBERS', host_holders_prefix .. h0), all)
  consider(redis.call('ZRANGEBYSCORE', pending_holders_prefix .. h0, now, '+inf'), all)
  consider(least_loaded(), window)
  for _, id in ipairs(gone) do
    redis.call('SREM', holders_prefix .. h0, id)
    redis.call('SREM', host_holders_prefix .. h0, id)
    redis.call('ZREM', pending_holders_prefix .. h0, id)
  end
end
for _, id in ipairs(gone) do
  redis.call('SREM', KEYS[1], id)
  redis.call('ZREM', KEYS[2], id)
end
table.insert(result, 1, mode)
return table.concat(result, ANSWER_SEP)
""".replace("WINDOW_REL", repr(WINDOW_REL)).replace("WINDOW_ABS_S", repr(WINDOW_ABS_S))
# A Lua decimal escape: the script's text stays printable.
LOOKUP_SCRIPT = LOOKUP_SCRIPT.replace("ANSWER_SEP", f"'\\{ord(ANSWER_SEP)}'")

# KEYS[1] = one engine's pending ZSET, KEYS[2] = the pending holders ZSET of the claim's first
# block; ARGV = seconds the entries count, chunk, engine id, hash width, the hashes
# concatenated. Expiry scores come from Redis' clock so every router replica judges them alike.
MARK_PENDING_SCRIPT = """
local time = redis.call('TIME')
local now = tonumber(time[1]) + tonumber(time[2]) / 1000000
local ttl, chunk = tonumber(ARGV[1]), tonumber(ARGV[2])
local expires = now + ttl
local keep = math.ceil(ttl) + 1
local width, blob = tonumber(ARGV[4]), ARGV[5]
local count = #blob / width
local i = 1
while i <= count do
  local args = {}
  for k = i, math.min(i + chunk - 1, count) do
    table.insert(args, expires)
    table.insert(args, string.sub(blob, (k - 1) * width + 1, k * width))
  end
  redis.call('ZADD', KEYS[1], 'GT', unpack(args))
  i = i + chunk
end
for _, key in ipairs(KEYS) do
  if key == KEYS[2] then redis.call('ZADD', key, 'GT', expires, ARGV[3]) end
  redis.call('ZREMRANGEBYSCORE', key, '-inf', now)
  if redis.call('TTL', key) < keep then redis.call('EXPIRE', key, keep) end
end
return 0
"""
