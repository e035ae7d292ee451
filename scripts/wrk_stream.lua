-- wrk script: closed-loop streaming completions against inference-lab serve.
-- Each connection sends the next request as soon as the previous response (the whole
-- chunked SSE body) has arrived, so wrk's latency is the client-observed E2E.
--   wrk -t1 -c24 -d15s --latency -s scripts/wrk_stream.lua http://127.0.0.1:8080/v1/completions
-- A 200-byte prompt is 50 prompt tokens; max_tokens 200 (override with WRK_MAX_TOKENS),
-- every answer run to it (ignore_eos).
local max_tokens = os.getenv("WRK_MAX_TOKENS") or "200"
local model = os.getenv("WRK_MODEL") or "gpt-oss-20b"
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
wrk.body = '{"model":"' .. model .. '","prompt":"' .. string.rep("x", 200) ..
    '","max_tokens":' .. max_tokens .. ',"ignore_eos":true,"stream":true}'

-- With WRK_JSON set, the run ends with one JSON line of exact figures (microseconds):
--   {"requests":N,"errors":N,"mean":us,"p50":us,"p90":us,"p99":us,"max":us,"seconds":s}
-- (bench_targets.py reads it; wrk's own report rounds to two decimals of its unit).
function done(summary, latency, requests)
  if os.getenv("WRK_JSON") == nil then return end
  local e = summary.errors
  io.write(string.format(
    '{"requests":%d,"errors":%d,"mean":%.1f,"p50":%d,"p90":%d,"p99":%d,"max":%d,"seconds":%.3f}\n',
    summary.requests, e.connect + e.read + e.write + e.status + e.timeout, latency.mean,
    latency:percentile(50), latency:percentile(90), latency:percentile(99), latency.max,
    summary.duration / 1e6))
end
