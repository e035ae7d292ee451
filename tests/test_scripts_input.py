"""The benchmark and experiment scripts refuse bad input with one line, never a traceback,
and before they start a server or write anything."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = ROOT / "scripts"

CASES = [
    ("bench_serve.py", ["--model", "no-such-model"], "no-such-model.toml: no such file"),
    ("bench_serve.py", ["--hardware", "zz", "--levels", "1"], "hardware.zz: no such entry"),
    ("bench_serve.py", ["--levels", "24,x"], "--levels: 'x' is neither C nor C>S"),
    ("bench_serve.py", ["--fresh-servers", "2", "--url", "http://127.0.0.1:9"], "takes no --url"),
    ("bench_serve.py", ["--duration", "0"], "--duration and --max-tokens must be positive"),
    ("bench_overload.py", ["--rates", "0,-5"], "each rate must be a number >= 0"),
    ("bench_overload.py", ["--rates", "0,x"], "not a list of numbers"),
    ("bench_overload.py", ["--model", "no-such-model"], "--model: "),
    ("bench_lora.py", ["--requests", "0"], "--requests: must be an integer >= 1, got 0"),
    ("bench_lora.py", ["--serve-rate", "0"], "--serve-rate: must be a number > 0"),
    ("bench_sim.py", ["--config", "no-such.toml"], "bench_sim: no-such.toml: no such file"),
    ("bench_sim.py", ["--requests", "0"], "--requests: must be an integer >= 1, got 0"),
    ("bench_fleet.py", ["--workers", "1,0"], "--workers: each value must be an integer >= 1"),
    ("bench_fleet.py", ["--replicas", "0"], "--replicas: must be an integer >= 1, got 0"),
    ("bench_tokenize.py", ["--tokenizer", "no-such.json"], "no such tokenizer file"),
    ("bench_pd_serve.py", ["--streams", "0"], "--streams must be at least 1"),
    ("bench_pd_serve.py", ["--requests", "4", "--streams", "4"], "must be more than --streams"),
    ("bench_pd_serve.py", ["--hardware", "zz"], "hardware.zz: no such entry"),
    ("bench_agents.py", ["--repeat", "0"], "--repeat must be at least 1"),
    ("bench_specdec.py", ["--batches", "1,0"], "--batches: each value must be an integer >= 1"),
    ("bench_specdec.py", ["--hardware", "zz"], "hardware.zz: no such entry"),
    ("bench_specdec.py", ["--policy", "32-2"], "--policy: '32-2' is not SEQS:GAMMA"),
    ("bench_specdec.py", ["--policy", "64:1,32:0"], "--policy: [1]: seqs must ascend"),
    ("bench_stack.py", ["--streams", "0"], "must be at least 1"),
    ("bench_stack.py", ["--paused", "0"], "--paused and --repeats must be at least 1"),
    ("bench_transport.py", ["--units", "0"], "--units, --repeats and --jobs must be at least 1"),
    ("bench_pd.py", ["--duration", "0"], "argument --duration: must be a number > 0"),
    ("bench_pd.py", ["--out", "no-such-dir/pd.png"], "bench_pd: --out: no such directory"),
    ("bench_cpu_budget.py", ["--config", "no-such-model"], "no-such-model.toml: no such file"),
    ("bench_cpu_budget.py", ["--hardware", "zz"], "hardware.zz: no such entry"),
    ("bench_cpu_budget.py", ["--requests", "0"], "--requests must be at least 1"),
    ("bench_targets.py", ["--runs", "0"], "--runs must be at least 1"),
    ("bench_targets.py", ["--duration", "0"], "--duration and --warmup must be positive"),
    ("capacity_experiment.py", ["--config", "no-such.toml", "--out", "OUT"], "no such file"),
    ("adaptive_experiment.py", ["--hardware", "zz", "--out", "OUT"], "hardware.zz: no such"),
]


@pytest.mark.parametrize(("script", "args", "message"), CASES)
def test_bad_input_is_one_line(script: str, args: list[str], message: str, tmp_path: Path) -> None:
    out = tmp_path / "out"
    args = [str(out) if arg == "OUT" else arg for arg in args]
    done = subprocess.run(
        [sys.executable, str(SCRIPTS / script), *args],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=60,
    )
    assert done.returncode != 0
    assert "Traceback" not in done.stderr
    lines = done.stderr.strip().splitlines()
    assert message in lines[-1], done.stderr
    # the message alone, or after argparse's usage
    assert len(lines) == 1 or lines[0].startswith("usage:"), done.stderr
    assert "listening on" not in done.stdout + done.stderr  # no server was started
    assert not out.exists()  # nothing was written


def test_bench_stack_prints_every_figure(tmp_path: Path) -> None:
    """A tiny run of the stack benchmark prints each of its figures (the numbers
    themselves are the machine's: only their presence and form are checked)."""
    args = ["--writes", "5", "--requests", "5", "--streams", "2", "--rounds", "5"]
    done = subprocess.run(
        [sys.executable, str(SCRIPTS / "bench_stack.py"), *args, "--paused", "3", "--repeats", "1"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    out = done.stdout
    for figure in (
        "per mid-stream write: ",
        "the same as body messages through hypercorn and h11: ",
        "per request (start + one body, keep-alive): ",
        "per token handed to 2 parked streams: ",
        "per request timed on its own (median of 3): ",
    ):
        assert figure in out, out
    for how in ("asleep", "spinning"):
        line = next(line for line in out.splitlines() if f"after a pause {how}: " in line)
        assert " us after 0.1 / 2 / 10 ms (x" in line, line


def test_bench_transport_prints_every_figure_of_a_workload(tmp_path: Path) -> None:
    """A tiny CPU-time run of the transport benchmark's request workload prints the cost
    with every hook on, one line per hook it switches off, and the arrival stamp's lead
    (the numbers are the machine's: only their presence and form are checked)."""
    args = ["--cpu", "--only", "request", "--units", "3", "--repeats", "1"]
    done = subprocess.run(
        [sys.executable, str(SCRIPTS / "bench_transport.py"), *args],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith("per keep-alive request: ") and "us of CPU" in lines[0]
    for hook in ("idle_timer", "nowait", "one_write", "close_watch", "stamp"):
        assert any(line.startswith(f"  {hook} off: ") for line in lines), done.stdout
    assert lines[-1].startswith("arrival before the app is called"), done.stdout
