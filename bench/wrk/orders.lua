-- wrk script: every request is a new order by a new buyer (admin token acting for a fresh
-- user_id, fresh Idempotency-Key) for one product, or with N for a product drawn at random
-- from PRODUCT_ID1 … PRODUCT_IDN, or with N and LINES for a cart of LINES distinct products
-- drawn from those, one unit each; counts responses by status.
-- usage: wrk -s bench/wrk/orders.lua URL -- ADMIN_TOKEN PRODUCT_ID [N [LINES]]
--
-- With WRK_RATE in the environment (requests a second, per wrk thread), the thread sends at
-- that rate whatever the answers' latency, as arriving shoppers would (an open arrival rate),
-- not a request per connection as soon as its last answer is in (wrk's closed loop): each
-- request takes the thread's next slot on a schedule of 1 / WRK_RATE apart, and waits for it.
-- The connections must outnumber the requests in flight (rate × latency), or the rate is not
-- reached; the closing lines say how far the schedule fell behind.
local threads = {}
local ffi = require("ffi")
ffi.cdef[[
  typedef struct { long tv_sec; long tv_nsec; } sg_timespec;
  int clock_gettime(int clk, sg_timespec *tp);
]]
local ts = ffi.new("sg_timespec")
local function now_ms()
  ffi.C.clock_gettime(1, ts) -- CLOCK_MONOTONIC
  return tonumber(ts.tv_sec) * 1000 + tonumber(ts.tv_nsec) / 1e6
end

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

-- Defined only with WRK_RATE: wrk looks for delay() once, and with one it routes every
-- request through a timer, which would change the closed loop of every other benchmark.
if os.getenv("WRK_RATE") then
  local interval, slot = 1000 / tonumber(os.getenv("WRK_RATE")), nil
  late = 0
  -- wrk calls it before every request, the first included. A schedule more than a second
  -- behind starts again a second behind: a backlog sent at once is bounded.
  function delay()
    local now = now_ms()
    slot = slot and math.max(slot + interval, now - 1000) or now
    if slot < now then late = math.max(late, now - slot) end
    return math.max(0, math.floor(slot - now))
  end
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
  for _, t in ipairs(threads) do
    local late = t:get("late")
    if late then io.write(string.format("schedule: at most %.1f ms behind\n", late)) end
  end
end
