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
