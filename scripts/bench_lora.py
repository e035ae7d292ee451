"""LoRA adapters: 8 adapters of Zipf popularity, max_loras 2 vs 4 vs 8, in ``sim`` and
against ``serve`` (docs/lora.md, docs/benchmarks.md).

Llama-3.1-8B-Instruct on one H100 serves 8 rank-16 adapters (``adapter-0`` the most
popular: weight ``1 / (i + 1)``), Poisson arrivals of 512-token prompts and 128-token
answers. For each ``max_loras`` the simulator's TTFT p50 / p99, output throughput, adapter
loads and skips (one per waiting request passed over for a slot in an admission pass). Then, for one
``max_loras`` (``--serve``), ``inference-lab serve`` with the same adapters gets an open
loop of streaming completions (token-id prompts, ``ignore_eos``), each naming its adapter,
and the engine is run on exactly the traffic the client sent (its send times, prompts,
lengths and adapters): TTFT and E2E p50 from the client (each read timed when the
kernel received its bytes, as ``inference-lab load`` times tokens) against the
simulator's; then
the same traffic naming the base model only, as a control. Targets: E2E p50 within 3 %,
TTFT p50 within 5 %.

    python scripts/bench_lora.py [--rate 24] [--requests 3000] [--serve 4] [--serve-requests 600]
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

import attrs
import numpy as np
import trio

from inference_lab.cli_args import CliParser, integer, number
from inference_lab.core.config import (
    AdapterMix,
    Deployment,
    FixedDist,
    LoraAdapter,
    LoraConfig,
    Workload,
    load_deployment,
    with_lora,
)
from inference_lab.core.engine import Engine, RequestSpec
from inference_lab.sim.run import run_simulation
from inference_lab.workload.adapters import AdapterPicker

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchkit import ServerProcess  # noqa: E402
from benchkit import one_stream as _one_stream  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "configs" / "Llama-3.1-8B-Instruct.toml"
HARDWARE = "h100"
NAMES = tuple(f"adapter-{i}" for i in range(8))
BASE = "Llama-3.1-8B-Instruct"
PROMPT, OUTPUT = 512, 128


def lora_deployment(max_loras: int) -> Deployment:
    lora = LoraConfig(
        max_loras=max_loras, max_lora_rank=16, adapters=tuple(LoraAdapter(name=n) for n in NAMES)
    )
    return with_lora(load_deployment(CONFIG, HARDWARE), lora, "bench_lora")


def workload(rate: float, requests: int) -> Workload:
    return Workload(
        arrival_pattern="poisson",
        arrival_rate=rate,
        input_len_dist=FixedDist(value=PROMPT),
        output_len_dist=FixedDist(value=OUTPUT),
        num_requests=requests,
        seed=7,
        adapters=AdapterMix(zipf=1.0),
    )


def sim_table(rate: float, requests: int) -> None:
    print(f"sim: {requests} requests at {rate:g}/s, {PROMPT}-token prompts, {OUTPUT} out\n")
    print("| max_loras | TTFT p50 ms | TTFT p99 ms | E2E p50 ms | output tok/s | loads | "
          "load ms | skips | wall s |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    for k in (2, 4, 8):
        start = time.perf_counter()
        r = run_simulation(lora_deployment(k), workload(rate, requests))
        wall = time.perf_counter() - start
        s, lora = r.summary, r.lora
        assert lora is not None
        print(
            f"| {k} | {s.ttft.p50:.2f} | {s.ttft.p99:.2f} | {s.e2e.p50:.1f} | "
            f"{s.output_tokens_per_s:,.0f} | {lora.loads:,} | {lora.load_seconds * 1e3:,.1f} | "
            f"{lora.skips:,} | {wall:.1f} |"
        )
    print()


@attrs.frozen
class Sent:
    """One request the client sent: when (s from the first), its adapter, TTFT, E2E."""

    at: float
    adapter: str
    ttft: float
    e2e: float
    status: int


def request_bytes(port: int, adapter: str, prompt: list[int]) -> bytes:
    body = json.dumps(
        {
            "model": adapter,
            "prompt": prompt,
            "max_tokens": OUTPUT,
            "ignore_eos": True,
            "stream": True,
        }
    ).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1:{port}\r\n"
        f"content-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


async def open_loop(url: str, rate: float, requests: int, base: str | None = None) -> list[Sent]:
    """Poisson arrivals, one connection per request, adapters drawn as ``sim`` draws
    them (every request names ``base`` instead when given: the control run); prompts of
    distinct random token ids (no prefix is shared)."""
    port = int(url.rsplit(":", 1)[1])
    rng = np.random.default_rng(11)
    gaps = rng.exponential(1.0 / rate, requests)
    picker = AdapterPicker(AdapterMix(zipf=1.0), NAMES, seed=7)
    adapters = picker.draws(requests) if base is None else [base] * requests
    prompts = rng.integers(1000, 30000, size=(requests, PROMPT)).tolist()
    out: list[Sent] = []
    t0 = time.perf_counter()

    async def one(at: float, adapter: str | None, prompt: list[int]) -> None:
        assert adapter is not None
        request = request_bytes(port, adapter, prompt)  # (encoding it is not timed)
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        async with stream:
            start = time.perf_counter()
            res = await _one_stream(stream, request, start, stamped=True)
            out.append(Sent(start - t0, adapter, res.ttft, res.e2e, res.status))

    async with trio.open_nursery() as nursery:
        due = 0.0
        for i in range(requests):
            due += float(gaps[i])
            await trio.sleep_until(trio.current_time() + max(0.0, t0 + due - time.perf_counter()))
            nursery.start_soon(one, due, adapters[i], prompts[i])
    return out


def simulate_sent(dep: Deployment, sent: list[Sent]) -> tuple[list[float], list[float]]:
    """The engine on exactly the client's traffic: TTFT and E2E (s) per request."""
    engine = Engine(dep)
    ids = []
    for s in sorted(sent, key=lambda s: s.at):
        spec = RequestSpec(
            prompt_tokens=PROMPT,
            max_tokens=OUTPUT,
            arrival_time=s.at,
            lora=s.adapter if s.adapter in NAMES else None,
        )
        ids.append(engine.submit(spec))
    ttft, e2e = [], []
    while engine.next_event_time() is not None:
        for f in engine.step().finished:
            ttft.append(f.first_token_time - f.arrival_time)
            e2e.append(f.finish_time - f.arrival_time)
    return ttft, e2e


def serve_comparison(max_loras: int, rate: float, requests: int) -> None:
    adapters = ", ".join(f'{{ name = "{n}" }}' for n in NAMES)
    with tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp) / "Llama-3.1-8B-Instruct-lora.toml"
        config.write_text(
            CONFIG.read_text()
            + f"\n[lora]\nmax_loras = {max_loras}\nmax_lora_rank = 16\nadapters = [{adapters}]\n"
        )
        args = ["--config", str(config), "--hardware", HARDWARE, "--max-waiting", "0"]
        with ServerProcess(args) as server:
            sent = trio.run(open_loop, server.url, rate, requests)
            control = trio.run(open_loop, server.url, rate, requests, BASE)
    report(max_loras, rate, sent, "adapters (Zipf)")
    report(max_loras, rate, control, f"control: every request names {BASE}")


def report(max_loras: int, rate: float, sent: list[Sent], what: str) -> None:
    ok = [s for s in sent if s.status == 200]
    ttft_sim, e2e_sim = simulate_sent(lora_deployment(max_loras), ok)

    def p50(xs: list[float]) -> float:
        return float(np.percentile(xs, 50)) * 1e3

    rows = (
        ("TTFT p50", p50([s.ttft for s in ok]), p50(ttft_sim)),
        ("E2E p50", p50([s.e2e for s in ok]), p50(e2e_sim)),
        ("TTFT p99", float(np.percentile([s.ttft for s in ok], 99)) * 1e3,
         float(np.percentile(ttft_sim, 99)) * 1e3),
    )  # fmt: skip
    print(f"serve: max_loras {max_loras}, {what}, {len(ok)} of {len(sent)} at {rate:g}/s\n")
    print("| figure | client ms | simulator ms (same traffic) | error |")
    print("|---|---|---|---|")
    for name, client, model in rows:
        print(f"| {name} | {client:.2f} | {model:.2f} | {(client / model - 1) * 100:+.2f} % |")
    print()


def main() -> int:
    parser = CliParser(prog="bench_lora", description=__doc__.splitlines()[0])
    parser.add_argument("--rate", type=number(gt=0), default=24.0, help="sim arrivals/s")
    parser.add_argument("--requests", type=integer(ge=1), default=3000, help="sim requests")
    parser.add_argument(
        "--serve", type=integer(ge=0), default=4, help="max_loras for serve (0: no serve run)"
    )
    parser.add_argument("--serve-rate", type=number(gt=0), default=12.0, help="serve arrivals/s")
    parser.add_argument("--serve-requests", type=integer(ge=1), default=600, help="serve requests")
    args = parser.parse_args()
    sim_table(args.rate, args.requests)
    if args.serve:
        serve_comparison(args.serve, args.serve_rate, args.serve_requests)
    return 0


if __name__ == "__main__":
    sys.exit(main())
