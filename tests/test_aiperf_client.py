"""aiperf (NVIDIA's benchmark client) against ``serve`` on a real socket: a short
``aiperf profile`` run (4 requests, 2 at a time) on its ``chat`` endpoint (streamed),
its ``messages`` endpoint (Anthropic's, streamed) and its ``cohere-rankings`` endpoint
(``/v2/rerank`` on a pooling model), each read back from aiperf's own exports: the
request count, no error recorded, and on the generating endpoints each answer's length
as aiperf counted it from the streamed text.

aiperf needs a Hugging Face tokenizer to synthesize prompts and count tokens, and there
is no network here: each run gets the demo tokenizer ``scripts/make_demo_tokenizer.py``
trains offline (each placeholder word one token), so the lengths aiperf counts are the
server's ``completion_tokens``. aiperf is not a test extra (it is part of the ``clients``
extra: ``make test-clients``), so the module skips where it is absent. aiperf runs as a
subprocess (it starts its own worker processes), about 15 s per run on an idle machine.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import attrs
import pytest
import trio

from inference_lab.core.config import load_deployment
from tests.conftest import CONFIGS, GPT, make_settings
from tests.serve_util import running_server

pytest.importorskip(
    "aiperf",
    reason="aiperf is not installed: `make test-clients` runs this file with the clients extra",
)
pytest.importorskip("tokenizers", reason="the demo tokenizer needs the tokenizer extra")
from make_demo_tokenizer import build  # noqa: E402 - scripts/ is on pytest's pythonpath

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="Linux sockets")

RERANKER = "Qwen3-Reranker-0.6B"
REQUESTS = 4
OUTPUT_TOKENS = 16


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("demo-tokenizer")
    build(out, [], vocab_size=8192, lines=2000, seed=0)
    return out


def settings() -> Any:
    """gpt-oss-20b (each answer runs to aiperf's ``max_tokens``) and the reranker."""
    reranker = load_deployment(CONFIGS / "pooling" / f"{RERANKER}.toml", "b200")
    base = make_settings()
    return attrs.evolve(
        base, deployments=(base.deployments[0], reranker), pooling_models=frozenset({RERANKER})
    )


async def profile(url: str, out: Path, tokenizer: Path, endpoint: str, model: str) -> Any:
    """One ``aiperf profile`` run of ``REQUESTS`` requests on ``endpoint``; its summary
    export (``profile_export_aiperf.json``) and per-request records."""
    command = [
        str(Path(sys.executable).parent / "aiperf"),
        "profile",
        *("--url", url, "--model", model, "--endpoint-type", endpoint),
        *("--tokenizer", str(tokenizer), "--request-count", str(REQUESTS)),
        *("--concurrency", "2", "--isl", "32", "--osl", str(OUTPUT_TOKENS)),
        *("--random-seed", "1", "--ui", "none", "--artifact-dir", str(out)),
    ]
    if endpoint != "cohere-rankings":
        command.append("--streaming")
    # (not HF_HUB_OFFLINE: aiperf 0.13 then looks a local tokenizer path up as a hub repo
    # id and fails; a local path is read without the network anyway)
    env = {**os.environ, "NO_COLOR": "1"}
    env.pop("HF_HUB_OFFLINE", None)
    env.pop("TRANSFORMERS_OFFLINE", None)
    done = await trio.run_process(
        command, cwd=out.parent, env=env, capture_stdout=True, capture_stderr=True, check=False
    )
    assert done.returncode == 0, (done.stdout + done.stderr).decode()[-3000:]
    summary = json.loads((out / "profile_export_aiperf.json").read_text())
    lines = (out / "profile_export.jsonl").read_text().splitlines()
    return summary, [json.loads(line) for line in lines]


@pytest.mark.parametrize(
    ("endpoint", "model"),
    [
        ("chat", GPT),  # /v1/chat/completions
        ("messages", GPT),  # /v1/messages
        ("cohere-rankings", RERANKER),  # /v2/rerank
    ],
)
async def test_an_aiperf_run_completes_without_errors(
    endpoint: str, model: str, tokenizer: Path, tmp_path: Path
) -> None:
    """aiperf's exports count ``REQUESTS`` requests and no error; the server admitted
    every one; a generating endpoint's answers are ``OUTPUT_TOKENS`` long by aiperf's
    count of the streamed text and by the usage the server reported."""
    with trio.fail_after(240):
        async with running_server(settings()) as (url, _, state):
            summary, records = await profile(url, tmp_path / endpoint, tokenizer, endpoint, model)
            snapshot = state.runtimes[model].snapshot()
    assert summary["request_count"]["avg"] == REQUESTS
    assert summary["error_summary"] == [] and not summary["was_cancelled"]
    assert "error_request_count" not in summary
    assert len(records) == REQUESTS
    assert all(record.get("error") is None for record in records)
    inputs = json.loads((tmp_path / endpoint / "inputs.json").read_text())
    assert all(p["model"] == model for s in inputs["data"] for p in s["payloads"])
    if endpoint == "cohere-rankings":
        documents = sum(len(p["documents"]) for s in inputs["data"] for p in s["payloads"])
        assert snapshot.admitted == documents  # (one prefill-only request per document)
        return
    assert snapshot.admitted == REQUESTS
    assert summary["output_sequence_length"]["avg"] == OUTPUT_TOKENS
    assert summary["usage_completion_tokens"]["avg"] == OUTPUT_TOKENS
    counted = [record["metrics"]["output_token_count"]["value"] for record in records]
    assert counted == [OUTPUT_TOKENS] * REQUESTS
    assert summary["time_to_first_token"]["avg"] > 0
