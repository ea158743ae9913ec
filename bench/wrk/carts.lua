-- wrk script: every request is a new cart (3 distinct products drawn from PRODUCT_PREFIX1 …
-- PRODUCT_PREFIXN, one unit each) by a new buyer (admin token acting for a fresh user_id,
-- fresh Idempotency-Key); counts responses by status.
-- usage: wrk -s bench/wrk/carts.lua URL -- ADMIN_TOKEN PRODUCT_PREFIX N
local threads = {}

function setup(thread)
  thread:set("tid", #threads)
  table.insert(threads, thread)
end

local function pid()
  local f = io.open("/proc/self/stat")
  if not f then return 0 end
  local p = tonumber(f:read("*l"):match("^(%d+)"))
  f:close()
  return p or 0
end

function init(args)
  token, prefix, count, n, codes = args[1], args[2], tonumber(args[3]), 0, {}
  proc = pid()
  math.randomseed(os.time() * 1000 + tid + proc * 7919)
end

function request()
  n = n + 1
  local who = string.format("wrk-%d-%d-%d-%d", proc, tid, n, math.random(1000000000))
  local a = math.random(1, count)
  local b = a
  while b == a do b = math.random(1, count) end
  local c = a
  while c == a or c == b do c = math.random(1, count) end
  local body = string.format(
    '{"lines":[{"product_id":"%s%d","quantity":1},{"product_id":"%s%d","quantity":1},{"product_id":"%s%d","quantity":1}],"user_id":"%s"}',
    prefix, a, prefix, b, prefix, c, who)
  return wrk.format("POST", "/v1/orders", {
    ["Authorization"] = "Bearer " .. token,
    ["Content-Type"] = "application/json",
    ["Idempotency-Key"] = who,
  }, body)
end

function response(status, headers, body)
  codes[status] = (codes[status] or 0) + 1
end

function done(summary, latency, requests)
  local total = {}
  for _, t in ipairs(threads) do
    for k, v in pairs(t:get("codes")) do total[k] = (total[k] or 0) + v end
  end
  for k, v in pairs(total) do io.write(string.format("status %d: %d\n", k, v)) end
end
