"""Lower ``max_num_seqs`` live under steady closed-loop load; compare with the roofline.

    .venv/bin/python scripts/capacity_experiment.py --out docs/
    .venv/bin/python scripts/capacity_experiment.py --url http://127.0.0.1:8080 --out /tmp/x

Without ``--url`` it starts ``inference-lab serve --config <shipped configs>/gpt-oss-20b.toml
--hardware b200`` on a free 127.0.0.1 port and stops it at the end. ``--clients`` closed-loop
clients (the package's load generator, ``inference_lab.client.load.run_load``, one worker
each, their starts staggered over one request lifetime so prefills do not arrive in lock-
step) keep streaming requests; ``--before`` seconds in, ``POST /control/capacity`` lowers
``max_num_seqs`` from ``--seqs-before`` to ``--seqs-after`` without a restart, and the load
stays on for ``--after`` seconds more. It prints latency and throughput of both phases,
their ratio, and the roofline's prediction of both, and writes ``capacity_experiment.png``
and ``capacity_experiment.json`` to ``--out``.

The prediction is ``benchkit.predict_closed_loop`` (P prompt tokens, L output
tokens, C clients, batch cap S, all from the same deployment the server runs; its docstring
has the formula).

The defaults (40 clients, 32 -> 8) keep the whole exchange within what one machine with
two cores can pace: above roughly 25,000 streamed tokens/s the server's HTTP writers and
the client compete for the CPU, the simulated clock falls behind wall-clock (see
``server_stats`` in the JSON) and the measured throughput drops below the roofline, which
is then a property of the host, not of the model. ``--clients 80 --seqs-before 64
--seqs-after 16`` shows it on such a host. ``clients > seqs-before`` keeps a few requests
waiting in both phases, so the batch never waits on a client's round trip.

Only 127.0.0.1 (or the ``--url`` origin) is contacted; the run is bounded by
``--before + --after`` plus one request's drain.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
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
from inference_lab.core.config import Deployment, load_deployment
from inference_lab.errors import ConfigError
from inference_lab.resources import shipped_dir

BIN = 0.5  # seconds per time-series bin


# -- the load ------------------------------------------------------------------------------


async def run_experiment(args: argparse.Namespace, url: str, dep: Deployment) -> dict[str, Any]:
    total = args.before + args.after
    before_pred = predict_closed_loop(
        dep, clients=args.clients, seqs=args.seqs_before, prompt=args.p, output=args.max_tokens
    )
    stagger = before_pred["e2e"] / args.clients
    try:
        entry = model_entry(await get_capacity(url), args.model)
    except KeyError as exc:
        raise SystemExit(f"capacity_experiment: {url}: {exc.args[0]}") from None
    await post_capacity(url, model=args.model, max_num_seqs=args.seqs_before, max_waiting=0)
    results: list[LoadResult] = []
    capacity: list[dict[str, Any]] = []
    change: dict[str, Any] = {}
    t0 = time.time()
    start = trio.current_time()

    async def client(i: int) -> None:
        await trio.sleep(i * stagger)
        config = LoadConfig(
            url=url,
            model=args.model,
            concurrency=1,
            duration=total - i * stagger,
            prompt_tokens=args.prompt_tokens,
            max_tokens=args.max_tokens,
            drain_timeout=30.0,
            sample_interval=1.0,
        )
        results.append(await run_load(config))

    async def poll(done: trio.Event) -> None:
        while not done.is_set():
            snap = model_entry(await get_capacity(url), args.model)
            snap["time"] = time.time() - t0
            capacity.append(snap)
            with trio.move_on_after(0.25):
                await done.wait()

    async def turn_dial() -> None:
        await trio.sleep_until(start + args.before)
        sent = time.time() - t0
        body = await post_capacity(url, model=args.model, max_num_seqs=args.seqs_after)
        change.update(time=(sent + time.time() - t0) / 2, response=body)
        print(
            f"t={change['time']:.2f}s POST /control/capacity max_num_seqs={args.seqs_after} "
            f"-> {body}",
            file=sys.stderr,
        )

    try:
        done = trio.Event()
        async with trio.open_nursery() as outer:
            outer.start_soon(poll, done)
            async with trio.open_nursery() as nursery:
                for i in range(args.clients):
                    nursery.start_soon(client, i)
                nursery.start_soon(turn_dial)
            done.set()
        stats = await get_stats(url)
    finally:
        with trio.CancelScope(shield=True):
            await post_capacity(
                url,
                model=args.model,
                max_num_seqs=entry["max_num_seqs"],
                max_waiting=entry["max_waiting"],
            )
    return {
        "t0": t0,
        "results": results,
        "capacity": capacity,
        "change": change,
        "server_stats": stats,
    }


# -- measurement ---------------------------------------------------------------------------


def _records(run: dict[str, Any]) -> tuple[list[dict[str, Any]], np.ndarray[Any, Any]]:
    """Every attempt with times relative to the experiment start, and every token's arrival
    time (same clock)."""
    rows: list[dict[str, Any]] = []
    tokens: list[np.ndarray[Any, Any]] = []
    for result in run["results"]:
        base = result.started_at - run["t0"]
        for r in result.records:
            times = np.frombuffer(r.token_times, dtype=np.float64) if r.token_times else None
            rows.append(
                {
                    "start": base + r.start,
                    "end": base + r.end,
                    "outcome": r.outcome,
                    "ttft": r.ttft,
                    "e2e": r.e2e,
                    "tpot": (
                        (times[-1] - times[0]) / (len(times) - 1)
                        if times is not None and len(times) > 1
                        else None
                    ),
                    "tokens": r.completion_tokens or 0,
                }
            )
            if times is not None and r.outcome == "ok":
                tokens.append(base + r.start + times)
    return rows, np.concatenate(tokens) if tokens else np.zeros(0)


def _median(values: list[float]) -> float | None:
    return float(np.median(values)) if values else None


def _phase(
    rows: list[dict[str, Any]], tokens: np.ndarray[Any, Any], lo: float, hi: float
) -> dict[str, Any]:
    """Throughput counts tokens that arrived in ``[lo, hi)``; latency covers the ok requests
    that started and ended inside it."""
    ok = [r for r in rows if r["outcome"] == "ok" and lo <= r["start"] and r["end"] <= hi]
    in_window = int(((tokens >= lo) & (tokens < hi)).sum())
    done = [r for r in rows if r["outcome"] == "ok" and lo <= r["end"] < hi]
    return {
        "window": [lo, hi],
        "requests": len(ok),
        "output_tokens_per_s": in_window / (hi - lo),
        "requests_per_s": len(done) / (hi - lo),
        "e2e_p50": _median([r["e2e"] for r in ok]),
        "ttft_p50": _median([r["ttft"] for r in ok if r["ttft"] is not None]),
        "tpot_p50": _median([r["tpot"] for r in ok if r["tpot"] is not None]),
        "e2e_mean": float(np.mean([r["e2e"] for r in ok])) if ok else None,
    }


def _timeseries(
    rows: list[dict[str, Any]], tokens: np.ndarray[Any, Any], end: float
) -> dict[str, list[Any]]:
    edges = np.arange(0.0, end + BIN, BIN)
    counts, _ = np.histogram(tokens, bins=edges)
    e2e: list[float | None] = []
    ttft: list[float | None] = []
    for lo, hi in zip(edges[:-1], edges[1:], strict=True):
        ended = [r for r in rows if r["outcome"] == "ok" and lo <= r["end"] < hi]
        e2e.append(_median([r["e2e"] for r in ended]))
        ttft.append(_median([r["ttft"] for r in ended if r["ttft"] is not None]))
    return {
        "time": [float(x) for x in (edges[:-1] + BIN / 2)],
        "output_tokens_per_s": [float(c) / BIN for c in counts],
        "e2e_p50": e2e,
        "ttft_p50": ttft,
    }


# -- output --------------------------------------------------------------------------------


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{1000 * x:.1f}"


def report(out: dict[str, Any]) -> str:
    m, p = out["measured"], out["predicted"]
    lines = [
        f"{out['model']} on {out['hardware']}: {out['clients']} closed-loop clients, "
        f"{out['prompt_tokens']} prompt / {out['max_tokens']} output tokens; "
        f"max_num_seqs {out['seqs_before']} -> {out['seqs_after']} at t={out['change_time']:.2f} s",
        f"{'':14}{'before':>18}{'after':>18}{'after/before':>22}",
        f"{'':14}{'meas':>9}{'pred':>9}{'meas':>9}{'pred':>9}{'meas':>11}{'pred':>11}",
    ]

    def row(label: str, key: str, scale: float, fmt: str) -> None:
        mb, ma = m["before"][key], m["after"][key]
        pb, pa = p["before"][key], p["after"][key]
        cells = [mb, pb, ma, pa]
        text = "".join(f"{'-' if v is None else format(v * scale, fmt):>9}" for v in cells)
        ratio_m = ma / mb if ma is not None and mb else None
        ratio_p = pa / pb
        text += f"{'-' if ratio_m is None else f'{ratio_m:.3f}':>11}{ratio_p:>11.3f}"
        lines.append(f"{label:14}{text}")

    row("tokens/s", "output_tokens_per_s", 1, ".0f")
    row("requests/s", "requests_per_s", 1, ".1f")
    row("E2E p50 ms", "e2e", 1000, ".1f")
    row("TTFT p50 ms", "ttft", 1000, ".1f")
    row("TPOT p50 ms", "tpot", 1000, ".3f")
    lines.append(
        "measured / predicted: "
        + ", ".join(f"{k} {v:+.1%}" for k, v in out["error_vs_prediction"].items())
    )
    return "\n".join(lines)


def plot(path: Path, out: dict[str, Any]) -> None:
    from matplotlib.figure import Figure

    ts = out["timeseries"]
    t = ts["time"]
    change = out["change_time"]
    p, m = out["predicted"], out["measured"]
    fig = Figure(figsize=(10, 8.5), layout="constrained")
    ax_tput, ax_lat, ax_srv = fig.subplots(3, 1, sharex=True)
    end = out["duration"]

    ax_tput.plot(t, [v / 1000 for v in ts["output_tokens_per_s"]], color="tab:blue", lw=1.5)
    for phase, lo, hi in (("before", 0.0, change), ("after", change, end)):
        ax_tput.hlines(
            p[phase]["output_tokens_per_s"] / 1000, lo, hi, colors="k", linestyles="--", lw=1
        )
    ax_tput.plot([], [], "k--", lw=1, label="roofline prediction")
    ax_tput.plot([], [], color="tab:blue", label=f"measured ({BIN:g} s bins)")
    ax_tput.set_ylabel("output tokens/s (thousands)")
    ax_tput.set_ylim(bottom=0)
    ax_tput.legend(loc="upper right", fontsize="small")
    ratio = m["after"]["output_tokens_per_s"] / m["before"]["output_tokens_per_s"]
    ax_tput.set_title(
        f"throughput {m['before']['output_tokens_per_s']:,.0f} → "
        f"{m['after']['output_tokens_per_s']:,.0f} tok/s (×{ratio:.3f}; roofline "
        f"×{p['after']['output_tokens_per_s'] / p['before']['output_tokens_per_s']:.3f})",
        fontsize="medium",
    )

    def series(key: str) -> tuple[list[float], list[float]]:
        pts = [(x, 1000 * v) for x, v in zip(t, ts[key], strict=True) if v is not None]
        return [a for a, _ in pts], [b for _, b in pts]

    ax_lat.plot(*series("e2e_p50"), color="tab:orange", label="E2E p50")
    ax_lat.plot(*series("ttft_p50"), color="tab:purple", label="TTFT p50")
    for phase, lo, hi in (("before", 0.0, change), ("after", change, end)):
        for key, color in (("e2e", "tab:orange"), ("ttft", "tab:purple")):
            ax_lat.hlines(1000 * p[phase][key], lo, hi, colors=color, linestyles="--", lw=1)
    ax_lat.plot([], [], "k--", lw=1, label="roofline prediction")
    ax_lat.set_ylabel("latency (ms, requests ending in bin)")
    lat_ratio = m["after"]["e2e"] / m["before"]["e2e"]
    ax_lat.set_title(
        f"E2E p50 {1000 * m['before']['e2e']:.0f} → {1000 * m['after']['e2e']:.0f} ms "
        f"(×{lat_ratio:.3f}; roofline ×{p['after']['e2e'] / p['before']['e2e']:.3f})",
        fontsize="medium",
    )
    ax_lat.set_ylim(bottom=0)
    ax_lat.legend(loc="upper left", fontsize="small")

    cap = out["server_capacity"]
    ct = cap["time"]
    ax_srv.plot(ct, cap["running"], color="tab:green", lw=2.5, label="running")
    ax_srv.plot(ct, cap["waiting"], color="tab:red", label="waiting")
    ax_srv.step(
        ct,
        cap["max_num_seqs"],
        where="post",
        color="k",
        lw=1,
        ls="--",
        label="max_num_seqs",
    )
    ax_srv.set_ylabel("requests (GET /control/capacity)")
    ax_srv.set_xlabel("time since start (s)")
    ax_srv.set_ylim(0, 1.3 * max(out["clients"], out["seqs_before"]))
    ax_srv.legend(loc="upper right", fontsize="small", ncols=3)

    for ax in (ax_tput, ax_lat, ax_srv):
        ax.axvline(change, color="0.3", lw=1, ls=":")
        ax.axvspan(*m["before"]["window"], color="tab:blue", alpha=0.06)
        ax.axvspan(*m["after"]["window"], color="tab:orange", alpha=0.06)
        ax.set_xlim(0, end)
    ax_tput.annotate(
        f"POST /control/capacity\nmax_num_seqs {out['seqs_before']} → {out['seqs_after']}",
        xy=(change, p["before"]["output_tokens_per_s"] / 2000),
        xytext=(8, 0),
        textcoords="offset points",
        fontsize="small",
        arrowprops={"arrowstyle": "-"},
    )
    fig.suptitle(
        f"{out['model']} on {out['hardware']}: {out['clients']} closed-loop clients, "
        f"max_num_seqs lowered live (shaded: measurement windows)"
    )
    fig.savefig(path, format="png", dpi=100)


# -- main ----------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    ap = CliParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", help="use this server instead of starting one (its own origin only)")
    ap.add_argument("--config", type=Path, default=shipped_dir("configs") / "gpt-oss-20b.toml")
    ap.add_argument("--hardware", default="b200")
    ap.add_argument("--model", default=None, help="model id (default: the config's name)")
    ap.add_argument("--clients", type=integer(ge=1), default=40)
    ap.add_argument("--seqs-before", type=integer(ge=1), default=32)
    ap.add_argument("--seqs-after", type=integer(ge=1), default=8)
    ap.add_argument("--before", type=number(gt=0), default=12.0, help="seconds before the change")
    ap.add_argument("--after", type=number(gt=0), default=16.0, help="seconds after the change")
    ap.add_argument(
        "--warmup", type=number(ge=0), default=2.0, help="seconds left out at the start"
    )
    ap.add_argument("--prompt-tokens", type=integer(ge=1), default=50)
    ap.add_argument("--max-tokens", type=integer(ge=1), default=200)
    ap.add_argument("--out", type=Path, required=True, help="directory for the PNG and JSON")
    ap.add_argument(
        "--replot", action="store_true", help="only redraw the PNG from the JSON in --out"
    )
    args = ap.parse_args(argv)
    if importlib.util.find_spec("matplotlib") is None:  # needed at the end: fail up front
        return fail(ap.prog, "needs matplotlib: pip install 'inference-lab[plot]'")
    if args.replot:
        saved: dict[str, Any] = json.loads((args.out / "capacity_experiment.json").read_text())
        plot(args.out / "capacity_experiment.png", saved)
        print(report(saved))
        return 0
    if args.warmup >= args.before:
        ap.error("--warmup must be shorter than --before")
    config = args.config.resolve()
    try:
        dep = load_deployment(config, args.hardware)
    except ConfigError as exc:
        print(f"capacity_experiment: {exc}", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    args.model = args.model or dep.model.name
    # The server's count of the chat prompt the client sends (exact: same rule as serve).
    args.p = chat_prompt_tokens(len(build_prompt(args.prompt_tokens, "chat")))

    if args.url:
        run = trio.run(run_experiment, args, args.url, dep)
    else:
        server_args = ["--config", str(config), "--hardware", args.hardware]
        server_args += ["--max-num-seqs", str(args.seqs_before)]
        with ServerProcess(server_args) as server:
            run = trio.run(run_experiment, args, server.url, dep)

    rows, tokens = _records(run)
    total = args.before + args.after
    change = run["change"]["time"]
    predicted = {
        phase: predict_closed_loop(
            dep, clients=args.clients, seqs=seqs, prompt=args.p, output=args.max_tokens
        )
        for phase, seqs in (("before", args.seqs_before), ("after", args.seqs_after))
    }
    # After the change the running batch drains to the new cap within one request lifetime
    # and the queue fills; skip one predicted E2E of the new regime (at least 1 s).
    settle = max(1.0, 1.5 * predicted["after"]["e2e"])
    measured = {
        "before": _phase(rows, tokens, args.warmup, change),
        "after": _phase(rows, tokens, change + settle, total),
    }
    for phase in measured.values():
        phase["e2e"] = phase.pop("e2e_p50")
        phase["ttft"] = phase.pop("ttft_p50")
        phase["tpot"] = phase.pop("tpot_p50")
    outcomes: dict[str, int] = {}
    for r in rows:
        outcomes[r["outcome"]] = outcomes.get(r["outcome"], 0) + 1

    def ratio(d: dict[str, Any], key: str) -> float:
        return float(d["after"][key] / d["before"][key])

    keys = ("output_tokens_per_s", "e2e", "ttft", "tpot")
    out: dict[str, Any] = {
        "model": args.model,
        "hardware": args.hardware,
        "config": config.name,
        "clients": args.clients,
        "prompt_tokens": args.p,
        "max_tokens": args.max_tokens,
        "seqs_before": args.seqs_before,
        "seqs_after": args.seqs_after,
        "duration": total,
        "change_time": change,
        "settle": settle,
        "outcomes": outcomes,
        "predicted": predicted,
        "measured": measured,
        "ratio_measured": {k: ratio(measured, k) for k in keys},
        "ratio_predicted": {k: ratio(predicted, k) for k in keys},
        "error_vs_prediction": {
            f"{phase} {k}": measured[phase][k] / predicted[phase][k] - 1
            for phase in ("before", "after")
            for k in ("output_tokens_per_s", "e2e")
        },
        "timeseries": _timeseries(rows, tokens, total),
        "server_capacity": columns(
            run["capacity"], ("time", "running", "waiting", "max_num_seqs", "max_waiting")
        ),
        "capacity_response": run["change"]["response"],
        "server_stats": run["server_stats"],
    }
    print(report(out))
    json_path = args.out / "capacity_experiment.json"
    json_path.write_text(json.dumps(rounded(out), indent=1, allow_nan=False) + "\n")
    png_path = args.out / "capacity_experiment.png"
    plot(png_path, out)
    print(f"wrote {png_path} and {json_path}")
    return 0 if all(math.isfinite(v) for v in out["ratio_measured"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
