"""Speculative decoding and DeepSeek-class serving in the simulator.

Prints two markdown tables (simulated figures, the same on any machine):

1. Llama-3.1-8B-Instruct with its EAGLE drafter (``configs/frontier/``, gamma 3 at a
   constant acceptance of 0.7) on ``--hardware``: for each closed-loop batch size of
   ``--batches``, the output throughput and TPOT without speculation, with it, and with
   ``--policy`` (``gamma_by_batch``: fewer draft tokens as the batch grows); the speed-up
   is each one's output throughput over the one without speculation;
2. DeepSeek-V3 on 8 x H200 (EP 8, data-parallel attention 8, MTP off, as measured) on the
   random-dataset cases of GPUStack's published SGLang benchmark
   (``docs/benchmarks.md#speculative-decoding-and-deepseek-v3``): all requests at once,
   fixed lengths; the simulated total token throughput next to the published one, with
   the datasheet profile and with ``h200-trtllm``'s calibrated efficiency.

    python scripts/bench_specdec.py [--hardware h200] [--batches 1,2,4,...] [--requests N]
                                    [--policy 96:2,160:1,224:0]
"""

from __future__ import annotations

import sys

import attrs

from inference_lab.cli_args import CliParser, integer
from inference_lab.core.config import (
    Deployment,
    FixedDist,
    LognormalDist,
    Workload,
    load_deployment,
    load_hardware_profile,
)
from inference_lab.errors import ConfigError
from inference_lab.resources import shipped_dir
from inference_lab.sim.run import SimResult, run_simulation

EAGLE = "frontier/Llama-3.1-8B-Instruct-EAGLE.toml"
DEEPSEEK = "frontier/DeepSeek-V3.toml"
#: GPUStack's DeepSeek-R1-0528 on 8 x H200 with SGLang v0.5.3, ``--tp 8
#: --enable-dp-attention`` (docs/performance-lab/deepseek-r1/h200.md of
#: github.com/gpustack/gpustack): (input, output, requests, total tokens/s).
PUBLISHED = (
    (2000, 100, 500, 19_024.33),
    (4000, 200, 500, 16_096.80),
    (32000, 100, 100, 16_091.68),
)


def _ints(text: str, what: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",")]
    except ValueError:
        raise SystemExit(f"bench_specdec: {what}: not a list of integers: {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise SystemExit(f"bench_specdec: {what}: each value must be an integer >= 1")
    return values


def _policy(text: str) -> tuple[tuple[int, int], ...]:
    pairs = []
    for part in text.split(","):
        seqs, _, gamma = part.partition(":")
        try:
            pairs.append((int(seqs), int(gamma)))
        except ValueError:
            raise SystemExit(
                f"bench_specdec: --policy: {part!r} is not SEQS:GAMMA (e.g. 32:2,64:1)"
            ) from None
    return tuple(pairs)


def without_speculation(dep: Deployment) -> Deployment:
    """The same deployment with no ``[speculative]``: no drafts, no drafter weights or KV."""
    return attrs.evolve(dep, speculative=None, acceptance_rates=())


def closed_loop(users: int, requests: int) -> Workload:
    """Chat-like lengths: input lognormal(6.5, 0.5) (median ~665), output lognormal(5.5,
    0.5) (median ~245); ``users`` users back to back."""
    return Workload(
        arrival_pattern="closed_loop",
        num_concurrent_users=users,
        input_len_dist=LognormalDist(mean=6.5, std_dev=0.5),
        output_len_dist=LognormalDist(mean=5.5, std_dev=0.5),
        num_requests=requests,
        seed=42,
    )


def _tpot(result: SimResult) -> str:
    p50 = result.summary.tpot.p50
    return "-" if p50 is None else f"{p50:.2f}"


def speedup_table(hardware: str, batches: list[int], requests: int, policy: str) -> None:
    base = load_deployment(shipped_dir("configs") / EAGLE, hardware)
    spec = base.speculative
    assert spec is not None
    policed = attrs.evolve(base, speculative=attrs.evolve(spec, gamma_by_batch=_policy(policy)))
    print(
        f"Llama-3.1-8B-Instruct + EAGLE (gamma {spec.num_speculative_tokens}, acceptance "
        f"{spec.acceptance_rate}) on {hardware}; closed loop, {requests} requests per point "
        f"(at least 4 per user); policy gamma_by_batch {policy}\n"
    )
    print(
        "| batch | plain tok/s | plain TPOT p50 (ms) | EAGLE tok/s | EAGLE TPOT p50 (ms) "
        "| speed-up | mean acceptance length | with policy tok/s | policy speed-up |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for users in batches:
        wl = closed_loop(users, max(requests, 4 * users))
        plain = run_simulation(without_speculation(base), wl)
        eagle = run_simulation(base, wl)
        policy_run = run_simulation(policed, wl)
        p, e, q = (r.summary.output_tokens_per_s for r in (plain, eagle, policy_run))
        assert eagle.speculative is not None
        print(
            f"| {users} | {p:,.0f} | {_tpot(plain)} | {e:,.0f} | {_tpot(eagle)} | "
            f"{e / p:.2f}x | {eagle.speculative.mean_acceptance_length:.2f} | {q:,.0f} | "
            f"{q / p:.2f}x |"
        )


def deepseek_table() -> None:
    dep = without_speculation(load_deployment(shipped_dir("configs") / DEEPSEEK, "h200"))
    calibrated = attrs.evolve(
        dep, profile=load_hardware_profile(shipped_dir("hardware_profiles") / "h200-trtllm.toml")
    )
    print(
        "\nDeepSeek-V3 on 8 x H200 (tp 8, ep 8, dp_attention 8; MTP off), all requests at "
        "t = 0, fixed lengths; published: GPUStack, SGLang v0.5.3 --tp 8 "
        "--enable-dp-attention, DeepSeek-R1-0528\n"
    )
    print(
        "| case | requests | published total tok/s | simulated, datasheet | ratio "
        "| simulated, h200-trtllm efficiency | ratio | simulated TPOT p50 (ms) |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for inp, out, count, published in PUBLISHED:
        wl = Workload(
            arrival_pattern="batched",
            input_len_dist=FixedDist(value=inp),
            output_len_dist=FixedDist(value=out),
            num_requests=count,
            seed=42,
        )
        sheet = run_simulation(dep, wl)
        cal = run_simulation(calibrated, wl)
        totals = [
            r.summary.input_tokens_per_s + r.summary.output_tokens_per_s for r in (sheet, cal)
        ]
        print(
            f"| {inp:,} in / {out} out | {count} | {published:,.0f} | {totals[0]:,.0f} | "
            f"{totals[0] / published:.2f}x | {totals[1]:,.0f} | {totals[1] / published:.2f}x | "
            f"{_tpot(cal)} |"
        )


def main() -> int:
    parser = CliParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hardware", default="h200")
    parser.add_argument("--batches", default="1,2,4,8,16,32,64,128,192,256")
    parser.add_argument("--requests", type=integer(ge=1), default=400)
    parser.add_argument("--policy", default="96:2,160:1,224:0")
    args = parser.parse_args()
    batches = _ints(args.batches, "--batches")
    try:
        load_deployment(shipped_dir("configs") / EAGLE, args.hardware)
    except ConfigError as exc:
        print(f"bench_specdec: {exc}", file=sys.stderr)
        return 2
    spec = load_deployment(shipped_dir("configs") / EAGLE, args.hardware).speculative
    assert spec is not None
    try:
        attrs.evolve(spec, gamma_by_batch=_policy(args.policy))
    except ValueError as exc:  # the config's own rule (FieldError)
        print(f"bench_specdec: --policy: {exc}", file=sys.stderr)
        return 2
    speedup_table(args.hardware, batches, args.requests, args.policy)
    deepseek_table()
    return 0


if __name__ == "__main__":
    sys.exit(main())
