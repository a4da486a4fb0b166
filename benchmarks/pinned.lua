-- wrk script for benchmarks/pinned.py: every request POSTs the chat completion body in TB_BODY.
-- With TB_CHECK set (a short pass before the measured rounds) it also reads each response body
-- (wrk keeps bodies only when `response` is defined, which costs the load generator CPU, hence
-- only then) and counts the whole ones: status 200 and, for a stream, exactly TB_CHUNKS content
-- chunks ending with the [DONE] event; for a reply, its usage; and the shortest whole body.
-- done() prints one line, "TBJSON {...}", that pinned.py reads.

wrk.method = "POST"
wrk.body = os.getenv("TB_BODY")
wrk.headers["Content-Type"] = "application/json"

local threads = {}

function setup(thread)
   table.insert(threads, thread)
end

local function count(body, needle)
   local n, at = 0, 1
   while true do
      local i = string.find(body, needle, at, true)
      if i == nil then return n end
      n, at = n + 1, i + #needle
   end
end

local function whole(body, chunks)
   if chunks == 0 then
      return string.find(body, '"completion_tokens":', 1, true) ~= nil
   end
   local tail = "data: [DONE]\n\n"
   return count(body, '"delta":{"content":"') == chunks and body:sub(-#tail) == tail
end

if os.getenv("TB_CHECK") then
   local chunks = tonumber(os.getenv("TB_CHUNKS"))
   checked, complete, shortest = 0, 0, math.huge

   function response(status, headers, body)
      checked = checked + 1
      if status == 200 and whole(body, chunks) then
         complete = complete + 1
         shortest = math.min(shortest, #body)
      end
   end
end

function done(summary, latency, requests)
   local checked, complete, shortest = 0, 0, 0
   for _, thread in ipairs(threads) do
      checked = checked + (thread:get("checked") or 0)
      complete = complete + (thread:get("complete") or 0)
      local s = thread:get("shortest")
      if s and s ~= math.huge and (shortest == 0 or s < shortest) then shortest = s end
   end
   local e = summary.errors
   io.write(string.format(
      'TBJSON {"requests":%d,"bytes":%d,"duration_us":%d,"connect_errors":%d,'
         .. '"read_errors":%d,"write_errors":%d,"status_errors":%d,"timeouts":%d,'
         .. '"checked":%d,"complete":%d,"shortest_body":%d,"latency_p50_us":%.1f,'
         .. '"latency_p99_us":%.1f}\n',
      summary.requests, summary.bytes, summary.duration, e.connect, e.read, e.write, e.status,
      e.timeout, checked, complete, shortest, latency:percentile(50), latency:percentile(99)))
end
