"""The AIMD client against a bounded queue, and the server's two capacity dials
(``max_num_seqs`` and ``max_waiting``, changed live through ``POST /control/capacity``).

    .venv/bin/python scripts/adaptive_experiment.py --out docs/
    .venv/bin/python scripts/adaptive_experiment.py --url http://127.0.0.1:8080 --out /tmp/x

Without ``--url`` it starts ``inference-lab serve --config <shipped configs>/gpt-oss-20b.toml
--hardware b200 --max-num-seqs S --max-waiting W`` on a free 127.0.0.1 port and stops it at
the end (with ``--url`` the same values are set through ``POST /control/capacity`` and the
server's own are restored afterwards). One run of the package's load generator in
adaptive mode (``inference_lab.client.load.run_load``, ``adaptive="aimd"``: the same code as
``inference-lab load --adaptive aimd``) streams long answers (``--max-tokens 400``, so a
request spends half a second in the server and the client's in-flight count is what the
server holds) through three phases of ``--phase`` seconds each, changed live:

    A  max_num_seqs S,  max_waiting W          529s start at S + W + 1 in flight
    B  max_waiting  W -> W2                    the 529 point moves; throughput does not
    C  max_num_seqs S -> S2                    throughput moves (and the 529 point with it)

For each phase it reports the limit at every AIMD cut (the "peak": how many requests were
in flight when a 529 came back), the limit the client settled at (time-weighted median
over the phase's last two thirds), the measured output throughput and the roofline's
(``benchkit.predict_closed_loop``: ``max_num_seqs / t_step``), and writes
``adaptive_experiment.png`` and ``adaptive_experiment.json`` to ``--out``.

Why ``W >= S`` by default: AIMD halves its limit on a 529, from ``S + W + 1`` to about
``(S + W) / 2``. With ``W >= S - 1`` that trough still fills all ``S`` batch slots, so the
engine runs a full batch all the time and throughput is set by ``max_num_seqs`` alone — the
point of phase B. With a smaller ``W`` (say ``S = 16, W = 8``) each halving
leaves the batch part-empty for a moment and raising ``W`` would also raise throughput a
little, by fixing the client's under-use rather than the server's capacity.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import trio
from benchkit import (
    ServerProcess,
    columns,
    get_capacity,
    get_stats,
    model_entry,
    post_capacity,
    predict_closed_loop,
    rounded,
)

from inference_lab.cli_args import CliParser, fail, integer, number
from inference_lab.client.load import LoadConfig, LoadResult, run_load
from inference_lab.client.wire import build_prompt, chat_prompt_tokens
from inference_lab.core.config import load_deployment
from inference_lab.errors import ConfigError
from inference_lab.resources import shipped_dir

BIN = 1.0  # seconds per throughput bin


async def run_experiment(args: argparse.Namespace, url: str) -> dict[str, Any]:
    try:
        entry = model_entry(await get_capacity(url), args.model)
    except KeyError as exc:
        raise SystemExit(f"adaptive_experiment: {url}: {exc.args[0]}") from None
    await post_capacity(url, model=args.model, max_num_seqs=args.seqs, max_waiting=args.waiting)
    config = LoadConfig(
        url=url,
        model=args.model,
        adaptive="aimd",
        concurrency=args.start,
        duration=3 * args.phase,
        prompt_tokens=args.prompt_tokens,
        max_tokens=args.max_tokens,
        window=args.window,
        backoff=args.backoff,
        sample_interval=0.1,
        drain_timeout=30.0,
    )
    changes: list[dict[str, Any]] = []
    capacity: list[dict[str, Any]] = []
    result: LoadResult | None = None
    unix_start = time.time()

    async def load(done: trio.Event) -> None:
        nonlocal result
        result = await run_load(config)
        done.set()

    async def dials() -> None:
        start = trio.current_time()
        for k, change in (
            (1, {"max_waiting": args.waiting_after}),
            (2, {"max_num_seqs": args.seqs_after}),
        ):
            await trio.sleep_until(start + k * args.phase)
            sent = time.time()
            body = await post_capacity(url, model=args.model, **change)
            changes.append({"unix": (sent + time.time()) / 2, "change": change, "response": body})
            print(f"POST /control/capacity {change} -> {body}", file=sys.stderr)

    async def poll(done: trio.Event) -> None:
        while not done.is_set():
            snap = model_entry(await get_capacity(url), args.model)
            snap["unix"] = time.time()
            capacity.append(snap)
            with trio.move_on_after(0.1):
                await done.wait()

    try:
        done = trio.Event()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(load, done)
            nursery.start_soon(dials)
            nursery.start_soon(poll, done)
        stats = await get_stats(url)
    finally:
        with trio.CancelScope(shield=True):
            await post_capacity(
                url,
                model=args.model,
                max_num_seqs=entry["max_num_seqs"],
                max_waiting=entry["max_waiting"],
            )
    assert result is not None
    return {
        "unix_start": unix_start,
        "result": result,
        "changes": changes,
        "capacity": capacity,
        "server_stats": stats,
    }


# -- analysis ------------------------------------------------------------------------------


def _weighted_median(changes: list[tuple[float, int]], lo: float, hi: float) -> float | None:
    """Time-weighted median of a step function ``changes`` (time, value) over [lo, hi]."""
    spans: dict[int, float] = {}
    for (t, v), nxt in zip(changes, [*changes[1:], (hi, 0)], strict=True):
        a, b = max(t, lo), min(nxt[0], hi)
        if b > a:
            spans[v] = spans.get(v, 0.0) + (b - a)
    if not spans:
        return None
    total = sum(spans.values())
    acc = 0.0
    for v in sorted(spans):
        acc += spans[v]
        if acc >= total / 2:
            return float(v)
    return None


def analyse(args: argparse.Namespace, run: dict[str, Any]) -> dict[str, Any]:
    result: LoadResult = run["result"]
    base = result.started_at  # unix time of the load generator's t = 0
    end = 3 * args.phase
    bounds = [0.0] + [c["unix"] - base for c in run["changes"]] + [end]
    settings = [
        (args.seqs, args.waiting),
        (args.seqs, args.waiting_after),
        (args.seqs_after, args.waiting_after),
    ]
    limits = list(result.limit_changes)
    cuts = [
        (t, prev) for (_, prev), (t, new) in zip(limits, limits[1:], strict=False) if new < prev
    ]
    token_times: list[np.ndarray[Any, Any]] = []
    for r in result.records:
        if r.outcome == "ok" and r.token_times:
            token_times.append(r.start + np.frombuffer(r.token_times, dtype=np.float64))
    tokens = np.concatenate(token_times) if token_times else np.zeros(0)
    overloaded = [r.start for r in result.records if r.outcome == "overloaded"]
    dep = args.deployment
    phases = []
    for k, (name, (seqs, waiting)) in enumerate(zip("ABC", settings, strict=True)):
        lo, hi = bounds[k], bounds[k + 1]
        # the client needs a moment to climb to the new point: measure the last 2/3
        settle_lo = lo + (hi - lo) / 3
        peaks = [p for t, p in cuts if lo <= t < hi]
        pred = predict_closed_loop(
            dep, clients=seqs, seqs=seqs, prompt=args.p, output=args.max_tokens
        )
        n_tokens = int(((tokens >= settle_lo) & (tokens < hi)).sum())
        phases.append(
            {
                "phase": name,
                "start": lo,
                "end": hi,
                "measured_from": settle_lo,
                "max_num_seqs": seqs,
                "max_waiting": waiting,
                "bound": seqs + waiting,
                "predicted_first_529_limit": seqs + waiting + 1,
                "peaks": peaks,
                "first_peak": peaks[0] if peaks else None,
                "peak_median": float(np.median(peaks)) if peaks else None,
                "cuts": len(peaks),
                "overloaded": sum(1 for t in overloaded if lo <= t < hi),
                "settled_limit": _weighted_median(limits, settle_lo, hi),
                "output_tokens_per_s": n_tokens / (hi - settle_lo),
                "predicted_output_tokens_per_s": pred["output_tokens_per_s"],
            }
        )
    edges = np.arange(0.0, end + BIN, BIN)
    counts, _ = np.histogram(tokens, bins=edges)
    outcomes: dict[str, int] = {}
    for r in result.records:
        outcomes[r.outcome] = outcomes.get(r.outcome, 0) + 1
    return {
        "model": args.model,
        "hardware": args.hardware,
        "config": args.config.name,
        "prompt_tokens": args.p,
        "max_tokens": args.max_tokens,
        "aimd": {"start": args.start, "window": args.window, "backoff": args.backoff},
        "phase_seconds": args.phase,
        "outcomes": outcomes,
        "phases": phases,
        "limit_changes": [[t, v] for t, v in limits],
        "in_flight": {
            "time": [s.time for s in result.samples],
            "in_flight": [s.in_flight for s in result.samples],
        },
        "throughput": {
            "time": [float(x) for x in edges[:-1] + BIN / 2],
            "output_tokens_per_s": [float(c) / BIN for c in counts],
        },
        "server_capacity": columns(
            [{**c, "time": c["unix"] - base} for c in run["capacity"]],
            ("time", "running", "waiting", "max_num_seqs", "max_waiting"),
        ),
        "capacity_changes": [
            {"time": c["unix"] - base, "change": c["change"], "response": c["response"]}
            for c in run["changes"]
        ],
        "server_stats": run["server_stats"],
    }


# -- output --------------------------------------------------------------------------------


def _num(x: float | None) -> str:
    return "-" if x is None else f"{x:g}"


def report(out: dict[str, Any]) -> str:
    lines = [
        f"{out['model']} on {out['hardware']}: AIMD (start {out['aimd']['start']}, window "
        f"{out['aimd']['window']}, backoff {out['aimd']['backoff']}), "
        f"{out['prompt_tokens']} prompt / {out['max_tokens']} output tokens, "
        f"{out['phase_seconds']:g} s per phase",
        f"{'phase':6}{'S':>4}{'W':>4}{'S+W+1':>7}{'first peak':>12}{'peak p50':>10}{'cuts':>6}"
        f"{'settled':>9}{'tok/s':>9}{'roofline':>10}",
    ]
    for p in out["phases"]:
        first = "-" if p["first_peak"] is None else str(p["first_peak"])
        median = "-" if p["peak_median"] is None else f"{p['peak_median']:g}"
        settled = "-" if p["settled_limit"] is None else f"{p['settled_limit']:g}"
        lines.append(
            f"{p['phase']:6}{p['max_num_seqs']:>4}{p['max_waiting']:>4}"
            f"{p['predicted_first_529_limit']:>7}{first:>12}{median:>10}{p['cuts']:>6}"
            f"{settled:>9}{p['output_tokens_per_s']:>9.0f}"
            f"{p['predicted_output_tokens_per_s']:>10.0f}"
        )
    a, b, c = out["phases"]
    lines.append(
        f"max_waiting {a['max_waiting']} -> {b['max_waiting']}: settled limit "
        f"{_num(a['settled_limit'])} -> {_num(b['settled_limit'])}, throughput x"
        f"{b['output_tokens_per_s'] / a['output_tokens_per_s']:.3f}"
    )
    lines.append(
        f"max_num_seqs {b['max_num_seqs']} -> {c['max_num_seqs']}: settled limit "
        f"{_num(b['settled_limit'])} -> {_num(c['settled_limit'])}, throughput x"
        f"{c['output_tokens_per_s'] / b['output_tokens_per_s']:.3f} (roofline x"
        f"{c['predicted_output_tokens_per_s'] / b['predicted_output_tokens_per_s']:.3f})"
    )
    return "\n".join(lines)


def plot(path: Path, out: dict[str, Any]) -> None:
    from matplotlib.figure import Figure

    phases = out["phases"]
    end = phases[-1]["end"]
    fig = Figure(figsize=(11, 9), layout="constrained")
    ax_lim, ax_tput, ax_srv = fig.subplots(
        3, 1, sharex=True, gridspec_kw={"height_ratios": [2.2, 1, 1]}
    )

    lc = out["limit_changes"]
    xs = [t for t, _ in lc] + [end]
    ys = [v for _, v in lc]
    ax_lim.step(xs, [*ys, ys[-1]], where="post", color="tab:blue", lw=1.4, label="AIMD limit")
    inf = out["in_flight"]
    ax_lim.plot(inf["time"], inf["in_flight"], color="0.55", lw=0.7, label="in flight")
    peak_t, peak_v = [], []
    for (_, prev), (t, new) in zip(lc, lc[1:], strict=False):
        if new < prev:
            peak_t.append(t)
            peak_v.append(prev)
    ax_lim.plot(peak_t, peak_v, "x", color="tab:red", ms=6, label="529 → cut (limit before)")
    for p in phases:
        ax_lim.hlines(
            p["predicted_first_529_limit"], p["start"], p["end"], colors="tab:red", ls="--", lw=1.2
        )
        ax_lim.text(
            p["start"] + 0.3,
            p["predicted_first_529_limit"] + 1,
            f"S+W+1 = {p['predicted_first_529_limit']}",
            color="tab:red",
            fontsize="small",
            va="bottom",
        )
        if p["settled_limit"] is not None:
            ax_lim.hlines(
                p["settled_limit"], p["measured_from"], p["end"], colors="tab:green", lw=2
            )
    ax_lim.plot([], [], color="tab:green", lw=2, label="settled (median, last 2/3)")
    ax_lim.plot([], [], "--", color="tab:red", lw=1.2, label="S + W + 1 (first 529)")
    top = max(p["predicted_first_529_limit"] for p in phases)
    ax_lim.set_ylim(0, top * 1.3)
    ax_lim.set_ylabel("requests in flight")
    ax_lim.legend(loc="lower right", fontsize="small", ncols=2)

    tp = out["throughput"]
    ax_tput.plot(
        tp["time"],
        [v / 1000 for v in tp["output_tokens_per_s"]],
        color="tab:blue",
        label=f"measured ({BIN:g} s bins)",
    )
    for p in phases:
        ax_tput.hlines(
            p["predicted_output_tokens_per_s"] / 1000, p["start"], p["end"], colors="k", ls="--"
        )
    ax_tput.plot([], [], "k--", label="roofline: max_num_seqs / t_step")
    ax_tput.set_ylabel("output tok/s (thousands)")
    ax_tput.set_ylim(0, max(p["predicted_output_tokens_per_s"] for p in phases) / 1000 * 1.35)
    ax_tput.legend(loc="upper left", fontsize="small", ncols=2)

    cap = out["server_capacity"]
    ct = cap["time"]
    ax_srv.plot(ct, cap["running"], color="tab:green", lw=1.2, label="running")
    ax_srv.plot(ct, cap["waiting"], color="tab:orange", lw=1, label="waiting")
    for key, color in (("max_num_seqs", "tab:green"), ("max_waiting", "tab:orange")):
        ax_srv.step(ct, cap[key], where="post", color=color, ls="--", lw=1, label=key)
    ax_srv.set_ylabel("server (GET /control/capacity)")
    ax_srv.set_xlabel("time since start (s)")
    ax_srv.set_ylim(0, max(max(cap["running"]), max(cap["waiting"])) * 1.45 + 1)
    ax_srv.legend(loc="upper left", fontsize="small", ncols=4)

    labels = [
        f"A: S={phases[0]['max_num_seqs']}, W={phases[0]['max_waiting']}",
        f"B: max_waiting → {phases[1]['max_waiting']}",
        f"C: max_num_seqs → {phases[2]['max_num_seqs']}",
    ]
    for ax in (ax_lim, ax_tput, ax_srv):
        for p in phases[1:]:
            ax.axvline(p["start"], color="0.2", lw=1, ls=":")
        ax.set_xlim(0, end)
    for p, label in zip(phases, labels, strict=True):
        settled = "-" if p["settled_limit"] is None else f"{p['settled_limit']:g}"
        ax_lim.text(
            (p["start"] + p["end"]) / 2,
            top * 1.27,
            f"{label}\nsettled {settled} · {p['output_tokens_per_s']:,.0f} tok/s",
            ha="center",
            va="top",
            fontsize="small",
            bbox={"boxstyle": "round", "fc": "white", "ec": "0.7"},
        )
    fig.suptitle(
        f"{out['model']} on {out['hardware']}: AIMD client vs. max_waiting and max_num_seqs, "
        "changed live (POST /control/capacity)"
    )
    fig.savefig(path, format="png", dpi=100)


# -- main ----------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    ap = CliParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", help="use this server instead of starting one (its own origin only)")
    ap.add_argument("--config", type=Path, default=shipped_dir("configs") / "gpt-oss-20b.toml")
    ap.add_argument("--hardware", default="b200")
    ap.add_argument("--model", default=None, help="model id (default: the config's name)")
    ap.add_argument("--seqs", type=integer(ge=1), default=16, help="max_num_seqs in phases A and B")
    ap.add_argument("--waiting", type=integer(ge=1), default=20, help="max_waiting in phase A")
    ap.add_argument(
        "--waiting-after", type=integer(ge=1), default=36, help="max_waiting in B and C"
    )
    ap.add_argument("--seqs-after", type=integer(ge=1), default=32, help="max_num_seqs in phase C")
    ap.add_argument("--phase", type=number(gt=0), default=25.0, help="seconds per phase")
    ap.add_argument("--start", type=integer(ge=1), default=8, help="the AIMD starting limit")
    ap.add_argument("--window", type=integer(ge=1), default=8)
    ap.add_argument("--backoff", type=number(gt=0, lt=1), default=0.5)
    ap.add_argument("--prompt-tokens", type=integer(ge=1), default=50)
    ap.add_argument("--max-tokens", type=integer(ge=1), default=400)
    ap.add_argument("--out", type=Path, required=True, help="directory for the PNG and JSON")
    ap.add_argument(
        "--replot", action="store_true", help="only redraw the PNG from the JSON in --out"
    )
    args = ap.parse_args(argv)
    if importlib.util.find_spec("matplotlib") is None:  # needed at the end: fail up front
        return fail(ap.prog, "needs matplotlib: pip install 'inference-lab[plot]'")
    if args.replot:
        out = json.loads((args.out / "adaptive_experiment.json").read_text())
        plot(args.out / "adaptive_experiment.png", out)
        print(report(out))
        return 0
    config = args.config.resolve()
    try:
        args.deployment = load_deployment(config, args.hardware)
    except ConfigError as exc:
        print(f"adaptive_experiment: {exc}", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    args.model = args.model or args.deployment.model.name
    args.p = chat_prompt_tokens(len(build_prompt(args.prompt_tokens, "chat")))

    if args.url:
        run = trio.run(run_experiment, args, args.url)
    else:
        server_args = ["--config", str(config), "--hardware", args.hardware]
        server_args += ["--max-num-seqs", str(args.seqs), "--max-waiting", str(args.waiting)]
        with ServerProcess(server_args) as server:
            run = trio.run(run_experiment, args, server.url)
    out = analyse(args, run)
    print(report(out))
    json_path = args.out / "adaptive_experiment.json"
    json_path.write_text(json.dumps(rounded(out), indent=1, allow_nan=False) + "\n")
    png_path = args.out / "adaptive_experiment.png"
    plot(png_path, out)
    print(f"wrote {png_path} and {json_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
