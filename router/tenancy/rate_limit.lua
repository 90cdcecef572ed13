-- One tenant's rate limits, checked and charged atomically for every router replica
-- (router/tenancy/rate_limit.py runs it; one call admits a request, one call finishes it).
--
-- Requests/s and tokens/min are GCRA (the generic cell rate algorithm, a token bucket kept
-- as one timestamp): each key holds the tenant's "theoretical arrival time" (TAT, ms); a
-- charge of c units moves it c * interval later; the charge is allowed while the new TAT
-- is at most burst * interval ahead of now. Concurrency is a sorted set of leases scored
-- by their expiry, so a crashed router's leases lapse on their own.
--
-- KEYS: 1 requests TAT, 2 tokens TAT, 3 concurrency leases (all of one tenant).
-- ARGV: 1 mode ("admit" | "finish"), 2 now in ms ("" = Redis TIME, tests pass a fixed
--   clock), 3 ms per request (0 = no limit), 4 request burst, 5 ms per token (0 = no limit),
--   6 token burst, 7 tokens to charge, 8 max concurrent (0 = no limit), 9 lease id,
--   10 lease time-to-live in ms.
-- admit returns {allowed 0|1, refused limit name or "", retry after ms (-1: never),
--   requests remaining, ms until the request bucket is full, tokens remaining, ms until
--   the token bucket is full, leases in use}. A refused admission changes nothing.
-- finish charges the generated tokens unconditionally (the bucket may go into debt, which
--   delays the tenant's next requests) and drops the lease; it returns {1}.

redis.replicate_commands()  -- Redis < 7: TIME before writes needs effects replication

local mode = ARGV[1]
local now
if ARGV[2] == '' then
  local t = redis.call('TIME')
  now = tonumber(t[1]) * 1000 + tonumber(t[2]) / 1000
else
  now = tonumber(ARGV[2])
end
local req_interval, req_burst = tonumber(ARGV[3]), tonumber(ARGV[4])
local tok_interval, tok_burst = tonumber(ARGV[5]), tonumber(ARGV[6])
local tokens = tonumber(ARGV[7])
local max_concurrent = tonumber(ARGV[8])
local lease, lease_ttl = ARGV[9], tonumber(ARGV[10])

local function tat_of(key)
  local stored = tonumber(redis.call('GET', key) or '')
  if stored == nil or stored < now then return now end
  return stored
end

local function store(key, tat)
  redis.call('SET', key, string.format('%.3f', tat), 'PX', math.ceil(tat - now) + 1000)
end

-- (allowed, new TAT, ms until allowed) for a charge of `cost` units.
local function gcra(tat, cost, interval, burst)
  local new_tat = tat + cost * interval
  local allow_at = new_tat - burst * interval
  if allow_at > now then return false, tat, allow_at - now end
  return true, new_tat, 0
end

local function remaining(tat, interval, burst)
  return math.max(0, math.floor((burst * interval - (tat - now)) / interval + 1e-9))
end

if mode == 'finish' then
  if tok_interval > 0 and tokens > 0 then
    store(KEYS[2], tat_of(KEYS[2]) + tokens * tok_interval)
  end
  if lease ~= '' then redis.call('ZREM', KEYS[3], lease) end
  return {1}
end

local refused, retry = '', 0
local req_tat, tok_tat = tat_of(KEYS[1]), tat_of(KEYS[2])
local new_req, new_tok = req_tat, tok_tat
if req_interval > 0 then
  local ok, tat, wait = gcra(req_tat, 1, req_interval, req_burst)
  if ok then new_req = tat else refused, retry = 'requests', wait end
end
if refused == '' and tok_interval > 0 then
  if tokens > tok_burst then
    refused, retry = 'tokens', -1  -- larger than the bucket: no wait makes it fit
  else
    local ok, tat, wait = gcra(tok_tat, tokens, tok_interval, tok_burst)
    if ok then new_tok = tat else refused, retry = 'tokens', wait end
  end
end
local in_use = 0
if max_concurrent > 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', now)
  in_use = redis.call('ZCARD', KEYS[3])
  if refused == '' and in_use >= max_concurrent then
    refused, retry = 'concurrency', 1000  -- no telling when a slot frees: ask again in 1 s
  end
end
if refused == '' then
  if req_interval > 0 then store(KEYS[1], new_req) end
  if tok_interval > 0 then store(KEYS[2], new_tok) end
  if max_concurrent > 0 then
    redis.call('ZADD', KEYS[3], now + lease_ttl, lease)
    redis.call('PEXPIRE', KEYS[3], lease_ttl + 1000)
    in_use = in_use + 1
  end
end
local req_left, req_reset, tok_left, tok_reset = -1, 0, -1, 0
if req_interval > 0 then
  req_left, req_reset = remaining(new_req, req_interval, req_burst), math.ceil(new_req - now)
end
if tok_interval > 0 then
  tok_left, tok_reset = remaining(new_tok, tok_interval, tok_burst), math.ceil(new_tok - now)
end
local allowed = 0
if refused == '' then allowed = 1 end
return {allowed, refused, math.ceil(retry), req_left, req_reset, tok_left, tok_reset, in_use}
