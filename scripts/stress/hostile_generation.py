"""Hostile generation, reply-size, store, secret and offline-tool inputs (issue 45), for
``scripts/stress/hostile.py``.

Against the live server (:func:`generation_cases`), one at a time while a prober asks
``/health`` every 5 ms:

- the issue's schemas and patterns (``^(a+)+$`` with a long enum, ``(a|a){20}(?!)``, an
  enum of 100,000 strings, ``(?=a){3000000}``, 10,000 required properties, ``minLength
  6000000`` at ``n = 128``): each answered or refused (400) as expected, with the
  slowest ``/health`` answer during it recorded;
- 100 distinct 1.5 MB ``guided_regex`` values (refused), then 100 distinct 30 KB ones
  (compiled and cached): the server's RSS before and after each;
- 300 stored responses, each a 480 KB function call (a few tokens: one letter run): RSS
  after, with the store's bound at 64 MiB.

Without a server (:func:`offline_cases`): an empty ``--api-key`` / control token, and the
offline tools' inputs of the issue (``plan`` with ``duration_s = 1e12``, ``calibrate``
with concurrency 1e7 / 1e300 and JSON nested 100,000 deep, ``sim --trace`` with a hash id
of 2**63, ``load --trace`` with ``input_length`` 2**63-1 and ``timestamp`` 1e308): each
one line on stderr, exit 1, no traceback, within seconds.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import trio
from common import CHAT, MODEL, ROOT, fetch, get, post, rss_mb

__all__ = ["generation_cases", "offline_cases"]

#: The slowest ``/health`` answer accepted while one hostile request is being generated
#: (each used to hold it for seconds to hours; what is left is the body's own parse, on
#: two shared cores).
HEALTH_BOUND_MS = 1000.0
#: Responses stored in the store case: 300 x 960 KB (arguments in the body and in the
#: conversation) is four times the store's 64 MiB.
STORED = 300
#: RSS growth accepted after each memory case (MB).
RSS_BOUND_MB = {"patterns_1_5mb": 50.0, "patterns_30kb": 120.0, "store": 150.0}


def chat(**extra: Any) -> bytes:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 8}
    return post(CHAT, json.dumps({**body, **extra}).encode())


def structured(schema: Any, **extra: Any) -> bytes:
    spec = {"name": "out", "schema": schema}
    return chat(response_format={"type": "json_schema", "json_schema": spec}, **extra)


def _required(count: int) -> dict[str, Any]:
    names = [f"p{i}" for i in range(count)]
    return {
        "type": "object",
        "properties": {n: {"type": "string"} for n in names},
        "required": names,
    }


#: (name, request, the status expected)
CASES: list[tuple[str, Callable[[], bytes], int]] = [
    (
        "backtracking_enum",
        lambda: structured({"type": "string", "enum": ["a" * 5000 + "!"], "pattern": "^(a+)+$"}),
        400,
    ),
    ("alternation_20", lambda: chat(guided_regex="(a|a){20}(?!)"), 400),
    (
        "enum_100k",
        lambda: structured({"type": "string", "enum": [f"v{i}" for i in range(100_000)]}),
        200,
    ),
    ("lookahead_3m", lambda: chat(guided_regex="(?=a){3000000}"), 400),
    ("required_10k", lambda: structured(_required(10_000)), 400),
    ("required_4k", lambda: structured(_required(4_000)), 200),
    (
        "min_length_6m_n128",
        lambda: structured({"type": "string", "minLength": 6_000_000, "pattern": "a"}, n=128),
        400,
    ),
]


async def _probe(port: int, stop: trio.Event, slowest: list[float]) -> None:
    while not stop.is_set():
        start = time.perf_counter()
        response = await fetch(port, get("/health"), 10)
        took = (time.perf_counter() - start) * 1e3
        slowest[0] = max(slowest[0], took if response.status == 200 else float("inf"))
        await trio.sleep(0.005)


async def _one(port: int, request: bytes) -> tuple[int, float, float]:
    """(status, seconds, slowest /health in ms) of ``request`` under the prober."""
    slowest = [0.0]
    stop = trio.Event()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_probe, port, stop, slowest)
        await trio.sleep(0.05)
        start = time.perf_counter()
        response = await fetch(port, request, 60)
        seconds = time.perf_counter() - start
        stop.set()
    return response.status, seconds, slowest[0]


def big_pattern(tag: str, size: int) -> str:
    """A distinct pattern of about ``size`` characters: a literal past any bound when
    ``size`` passes 32,768, else an alternation of 5-digit words (compiled, cached and
    answered)."""
    if size > 32_768:
        return tag + "a" * (size - len(tag))
    words = "|".join(f"{j:05d}" for j in range((size - len(tag) - 4) // 6))
    return f"{tag}(?:{words})"


async def _patterns(port: int, size: int, count: int, tag: str) -> list[int]:
    statuses = []
    for i in range(count):
        pattern = big_pattern(f"{tag}{i:04d}", size)
        statuses.append((await fetch(port, chat(guided_regex=pattern), 60)).status)
    return statuses


#: A tool whose arguments are 480 KB and a handful of tokens (a letters-only string is one).
BLOB_TOOL = {
    "type": "function",
    "name": "f",
    "parameters": {
        "type": "object",
        "properties": {"blob": {"type": "string", "minLength": 480_000, "pattern": "x"}},
        "required": ["blob"],
    },
}


async def _store(port: int, count: int) -> list[int]:
    """``count`` stored responses, each a call of :data:`BLOB_TOOL` (its 480 KB arguments
    in the body and in the conversation kept)."""
    statuses = []
    for i in range(count):
        body = {"model": MODEL, "input": f"go {i}", "tools": [BLOB_TOOL], "tool_choice": "required"}
        response = await fetch(port, post("/v1/responses", json.dumps(body).encode()), 60)
        statuses.append(response.status)
    return statuses


async def generation_cases(port: int, pid: int, figures: dict[str, Any]) -> bool:
    """The live-server cases of the module docstring; their figures go to ``figures``
    (``gen_*``); True when every one held."""
    ok = True
    slowest = [0.0]
    stop = trio.Event()
    async with trio.open_nursery() as nursery:  # the prober alone: the machine's own noise
        nursery.start_soon(_probe, port, stop, slowest)
        await trio.sleep(2.0)
        stop.set()
    figures["gen_health_quiet_max_ms"] = round(slowest[0], 1)
    for name, make, want in CASES:
        status, seconds, slowest = await _one(port, make())
        figures[f"gen_{name}"] = f"{status} in {seconds:.2f} s, /health max {slowest:.1f} ms"
        ok &= status == want and slowest <= HEALTH_BOUND_MS
    for key, size, tag, want in (
        ("patterns_1_5mb", 1_500_000, "b", 400),
        ("patterns_30kb", 30_000, "c", 200),
    ):
        before = rss_mb(pid)
        start = time.perf_counter()
        statuses = await _patterns(port, size, 100, tag)
        seconds = time.perf_counter() - start
        after = rss_mb(pid)
        figures[f"gen_rss_{key}"] = [round(before, 1), round(after, 1)]
        figures[f"gen_{key}_seconds"] = round(seconds, 1)
        ok &= statuses == [want] * 100 and after - before <= RSS_BOUND_MB[key]
    before = rss_mb(pid)
    start = time.perf_counter()
    statuses = await _store(port, STORED)
    figures["gen_store_seconds"] = round(time.perf_counter() - start, 1)
    after = rss_mb(pid)
    figures["gen_rss_store"] = [round(before, 1), round(after, 1)]
    ok &= statuses == [200] * STORED and after - before <= RSS_BOUND_MB["store"]
    return ok


# ---------------------------------------------------------------------------------------
# without a server


def _cli(args: list[str], env: dict[str, str] | None = None) -> tuple[int, list[str], float]:
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "inference_lab.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env={**os.environ, **(env or {})},
    )
    lines = done.stderr.strip().splitlines()
    return done.returncode, lines, time.perf_counter() - start


def _files(tmp: Path) -> dict[str, Path]:
    out: dict[str, Path] = {}
    plan = (ROOT / "configs" / "plans" / "chat-20rps.toml").read_text()
    plan = plan.replace('"../', f'"{ROOT}/configs/').replace("duration_s = 30", "duration_s = 1e12")
    out["plan"] = tmp / "plan.toml"
    out["plan"].write_text(plan)
    load_doc = {
        "config": {"model": MODEL, "concurrency": 8, "rate": None},
        "summary": {"mode": "closed", "requests": 100, "prompt_tokens_mean": 50.0,
                    "completion_tokens_mean": 100.0, "ttft": {"mean": 0.02}},
    }  # fmt: skip
    for key, value in (("c1e7", 10_000_000), ("c1e300", 1e300)):
        doc = {**load_doc, "config": {**load_doc["config"], "concurrency": value}}
        out[key] = tmp / f"{key}.json"
        out[key].write_text(json.dumps(doc))
    out["deep"] = tmp / "deep.json"
    out["deep"].write_text("[" * 100_000 + "]" * 100_000)
    rows = {
        "hash": [{"timestamp": 0, "input_length": 1024, "output_length": 4, "hash_ids": [2**63]}],
        "input": [{"timestamp": 0, "input_length": 2**63 - 1, "output_length": 4}],
        "time": [
            {"timestamp": 0, "input_length": 5, "output_length": 4},
            {"timestamp": 1e308, "input_length": 5, "output_length": 4},
        ],
    }
    for key, lines in rows.items():
        out[key] = tmp / f"{key}.jsonl"
        out[key].write_text("".join(json.dumps(row) + "\n" for row in lines))
    return out


def offline_cases(figures: dict[str, Any]) -> bool:
    """The server-less cases of the module docstring (``off_*`` figures)."""
    config = str(ROOT / "configs" / "gpt-oss-20b.toml")
    load = ["load", "--url", "http://127.0.0.1:9", "--model", MODEL, "--trace"]
    ok = True
    with tempfile.TemporaryDirectory(prefix="inference-lab-hostile-") as name:
        f = _files(Path(name))
        calibrate = ["calibrate", "--config", config, "--hardware", "b200"]
        cases: list[tuple[str, list[str], dict[str, str] | None]] = [
            ("empty_api_key", ["serve", "--config", config, "--api-key", ""], None),
            ("empty_token_env", ["serve", "--config", config],
             {"INFERENCE_LAB_CONTROL_TOKEN": ""}),
            ("plan_1e12", ["plan", str(f["plan"]), "-q"], None),
            ("calibrate_1e7", [*calibrate, str(f["c1e7"])], None),
            ("calibrate_1e300", [*calibrate, str(f["c1e300"])], None),
            ("calibrate_deep", [*calibrate, str(f["deep"])], None),
            ("sim_hash_2_63", ["sim", "--config", config, "--hardware", "b200", "--trace",
                               str(f["hash"])], None),
            ("load_input_2_63", [*load, str(f["input"])], None),
            ("load_time_1e308", [*load, str(f["time"])], None),
        ]  # fmt: skip
        for key, args, env in cases:
            code, lines, seconds = _cli(args, env)
            one_line = len(lines) == 1 and "Traceback" not in "".join(lines)
            figures[f"off_{key}"] = f"exit {code} in {seconds:.1f} s: {lines[-1] if lines else ''}"
            ok &= code == 1 and one_line and seconds < 60
    return ok
