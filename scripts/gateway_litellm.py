"""How litellm treats the server's 529: the exception a caller sees, how many attempts
reach the server and how long the call takes, per retry setting.

Needs litellm, which the project does not depend on (``pip install litellm`` in a separate
environment), and a server with one seat and one waiting place::

    inference-lab serve --port 8231 --config gpt-oss-20b --max-num-seqs 1 --max-waiting 1 &
    LITELLM_LOCAL_MODEL_COST_MAP=True python scripts/gateway_litellm.py --port 8231

Before each trial it fills the seat and the place with long streams (only 127.0.0.1), then
makes one call and prints one JSON line: the setting, the 529s the server counted
(``inference_lab:requests_rejected_total``), the seconds the call took and its outcome.
Each trial is bounded by the streams' length (100,000 tokens: about a minute).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import threading
import time
import urllib.request
from collections.abc import Callable
from typing import Any

MODEL = "gpt-oss-20b"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()
    base = f"http://127.0.0.1:{args.port}"

    import litellm  # noqa: PLC0415 - an optional tool, not a project dependency
    from litellm import Router
    from litellm.router import RetryPolicy

    def rejected() -> float:
        text = urllib.request.urlopen(base + "/metrics").read().decode()
        for line in text.splitlines():
            if line.startswith("inference_lab:requests_rejected_total") and "queue_sat" in line:
                return float(line.split()[-1])
        return 0.0

    def capacity() -> dict[str, Any]:
        entry: dict[str, Any] = json.loads(
            urllib.request.urlopen(base + "/control/capacity").read()
        )[0]
        return entry

    def hold_one() -> None:
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": "x"}],
            "max_tokens": 100_000,
            "stream": True,
        }
        request = urllib.request.Request(
            base + "/v1/chat/completions",
            data=json.dumps(body).encode(),
            headers={"content-type": "application/json"},
        )

        def read() -> None:
            try:
                with urllib.request.urlopen(request, timeout=600) as response:
                    for _ in response:
                        pass
            except OSError:
                pass

        threading.Thread(target=read, daemon=True).start()

    def saturate() -> None:
        while True:
            entry = capacity()
            if entry["running"] >= 1 and entry["waiting"] >= 1:
                return
            hold_one()
            time.sleep(0.5)

    def trial(name: str, call: Callable[[], Any]) -> None:
        saturate()
        before = rejected()
        start = time.monotonic()
        try:
            call()
            outcome = "ok"
        except Exception as exc:  # noqa: BLE001 - reporting what the caller would see
            status = getattr(exc, "status_code", None)
            outcome = f"{type(exc).__module__}.{type(exc).__name__} (status_code {status})"
        print(
            json.dumps(
                {
                    "setting": name,
                    "refusals_at_the_server": rejected() - before,
                    "seconds": round(time.monotonic() - start, 2),
                    "outcome": outcome,
                }
            ),
            flush=True,
        )

    messages = [{"role": "user", "content": "hi"}]
    params = {"model": f"openai/{MODEL}", "api_base": base + "/v1", "api_key": "unused"}
    no_client_retries = {**params, "max_retries": 0}
    print(json.dumps({"litellm": importlib.metadata.version("litellm")}))
    trial("completion (defaults)", lambda: litellm.completion(messages=messages, **params))
    trial(
        "Router (defaults)",
        lambda: Router(model_list=[{"model_name": MODEL, "litellm_params": params}]).completion(
            model=MODEL, messages=messages
        ),
    )
    trial(
        "Router num_retries=0",
        lambda: Router(
            model_list=[{"model_name": MODEL, "litellm_params": no_client_retries}], num_retries=0
        ).completion(model=MODEL, messages=messages),
    )
    trial(
        "Router num_retries=2, retry_policy InternalServerErrorRetries=0",
        lambda: Router(
            model_list=[{"model_name": MODEL, "litellm_params": no_client_retries}],
            num_retries=2,
            retry_policy=RetryPolicy(InternalServerErrorRetries=0),
        ).completion(model=MODEL, messages=messages),
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
