-- wrk script: every request is a new order by a new buyer (admin token acting for a fresh
-- user_id, fresh Idempotency-Key) for one product, or with N for a product drawn at random
-- from PRODUCT_ID1 … PRODUCT_IDN, or with N and LINES for a cart of LINES distinct products
-- drawn from those, one unit each; counts responses by status.
-- usage: wrk -s bench/wrk/orders.lua URL -- ADMIN_TOKEN PRODUCT_ID [N [LINES]]
local threads = {}

function setup(thread)
  thread:set("tid", #threads)
  table.insert(threads, thread)
end

-- This wrk process's id: several wrk processes started in the same second (one per
-- instance, bench/fresh.sh scale) must not draw the same buyers and keys, or their "orders" are
-- replays of each other's.
local function pid()
  local f = io.open("/proc/self/stat")
  if not f then return 0 end
  local p = tonumber(f:read("*l"):match("^(%d+)"))
  f:close()
  return p or 0
end

function init(args)
  token, product, spread, n, codes = args[1], args[2], tonumber(args[3]), 0, {}
  lines = tonumber(args[4]) or 1
  proc = pid()
  math.randomseed(os.time() * 1000 + tid + proc * 7919)
end

function request()
  n = n + 1
  local who = string.format("wrk-%d-%d-%d-%d", proc, tid, n, math.random(1000000000))
  local body
  if lines > 1 then
    local picked, items = {}, {}
    while #items < lines do
      local i = math.random(1, spread)
      if not picked[i] then
        picked[i] = true
        table.insert(items, string.format('{"product_id":"%s%d","quantity":1}', product, i))
      end
    end
    body = string.format('{"lines":[%s],"user_id":"%s"}', table.concat(items, ","), who)
  else
    local p = spread and (product .. math.random(1, spread)) or product
    body = string.format('{"product_id":"%s","quantity":1,"user_id":"%s"}', p, who)
  end
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
