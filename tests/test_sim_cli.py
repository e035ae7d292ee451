"""`inference-lab sim`: end to end runs, outputs, determinism, closed loops, one-line errors."""

from __future__ import annotations

import argparse
import csv
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from inference_lab import cli
from inference_lab.core.config import load_deployment, load_workload, override_scheduler
from inference_lab.resources import shipped_names
from inference_lab.sim import cli as sim_cli
from inference_lab.sim.run import Progress, run_simulation
from inference_lab.sim.text import format_summary

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = ROOT / "configs"
GPT_OSS = str(CONFIGS / "gpt-oss-20b.toml")
LLAMA_70B = str(CONFIGS / "Llama-3-70B.toml")
QUICK = str(CONFIGS / "workloads" / "quick.toml")


def write(path: Path, text: str) -> str:
    path.write_text(text)
    return str(path)


def run_cli(*argv: str) -> int:
    """``inference-lab sim ARGV`` in this process; returns the exit code."""
    return cli.main(["sim", *argv])


def without_wall_time(doc: dict[str, Any]) -> dict[str, Any]:
    out = dict(doc)
    out["time"] = {k: v for k, v in doc["time"].items() if k == "simulated_s"}
    return out


def test_quick_end_to_end_prints_config_and_summary(capsys: pytest.CaptureFixture[str]) -> None:
    """`sim` on `quick` completes all 50 requests and prints the configuration and the table."""
    rc = run_cli("--config", GPT_OSS, "--hardware", "b200", "--workload", QUICK)
    out = capsys.readouterr().out
    assert rc == 0
    assert "gpt-oss-20b" in out and "NVIDIA B200" in out and "poisson" in out
    for row in ("TTFT", "TPOT", "E2E", "queue"):
        assert any(line.startswith(row) for line in out.splitlines())
    assert "50 completed, 0 refused" in out
    assert "simulated in" in out


def test_quiet_prints_only_the_summary(capsys: pytest.CaptureFixture[str]) -> None:
    """-q drops the configuration print (and the progress bar); the summary remains."""
    rc = run_cli("--config", GPT_OSS, "--hardware", "b200", "--workload", QUICK, "-q")
    captured = capsys.readouterr()
    assert rc == 0
    assert "scheduler" not in captured.out
    assert captured.out.startswith("latency (ms)")
    assert captured.err == ""


def test_json_output_has_the_summary_sections(tmp_path: Path) -> None:
    """-o writes the configuration and every summary section as JSON."""
    out = tmp_path / "result.json"
    rc = run_cli(
        "--config", GPT_OSS, "--hardware", "b200", "--workload", QUICK, "-q", "-o", str(out)
    )
    assert rc == 0
    doc = json.loads(out.read_text())
    assert set(doc) >= {
        "config",
        "requests",
        "latency_ms",
        "throughput",
        "utilisation",
        "preemptions",
        "peak_waiting",
        "time",
    }
    assert doc["config"]["model"] == "gpt-oss-20b"
    assert doc["config"]["hardware"] == "b200"
    assert doc["config"]["workload"]["seed"] == 42
    assert doc["requests"] == {"submitted": 50, "completed": 50, "refused": 0}
    ttft = doc["latency_ms"]["ttft"]
    assert set(ttft) == {"count", "min", "mean", "p50", "p90", "p95", "p99", "max"}
    assert 0 < ttft["min"] <= ttft["p50"] <= ttft["p99"] <= ttft["max"]
    assert doc["throughput"]["output_tokens_per_s"] > 0
    assert 0 < doc["utilisation"]["bw_util_mean"] <= 1
    assert doc["time"]["simulated_s"] > 0


def test_request_csv_has_one_row_per_request(tmp_path: Path) -> None:
    """--request-csv writes a header and one row per request, with consistent timings."""
    path = tmp_path / "r.csv"
    rc = run_cli(
        "--config", GPT_OSS, "--hardware", "b200", "--workload", QUICK, "-q",
        "--request-csv", str(path),
    )  # fmt: skip
    assert rc == 0
    with path.open(newline="") as fh:
        rows = list(csv.DictReader(fh))
    assert len(rows) == 50
    assert len({r["request_id"] for r in rows}) == 50
    for r in rows:
        assert r["status"] == "completed"
        assert r["finish_reason"] == "length"  # max_tokens = the sampled output length
        assert r["output_tokens"] == r["max_tokens"]
        assert (
            float(r["arrival_time_s"])
            <= float(r["first_token_time_s"])
            <= float(r["finish_time_s"])
        )
        assert float(r["e2e_ms"]) >= float(r["ttft_ms"]) >= float(r["queue_ms"]) >= 0
    arrivals = [float(r["arrival_time_s"]) for r in rows]
    assert arrivals == sorted(arrivals)


def test_single_token_requests_have_no_tpot(tmp_path: Path) -> None:
    """Requests producing one token finish fine; TPOT is empty in the CSV and null in JSON."""
    wl = write(
        tmp_path / "one.toml",
        'arrival_pattern = "uniform"\narrival_rate = 5.0\nnum_requests = 10\n'
        'input_len_dist = { type = "fixed", value = 300 }\n'
        'output_len_dist = { type = "fixed", value = 1 }\nseed = 1\n',
    )
    csv_path, out = tmp_path / "r.csv", tmp_path / "r.json"
    argv = ["--config", GPT_OSS, "--hardware", "b200", "--workload", wl, "-q"]
    assert run_cli(*argv, "-o", str(out), "--request-csv", str(csv_path)) == 0
    with csv_path.open(newline="") as fh:
        rows = list(csv.DictReader(fh))
    assert len(rows) == 10
    assert {r["tpot_ms"] for r in rows} == {""}
    assert {r["output_tokens"] for r in rows} == {"1"}
    doc = json.loads(out.read_text())
    assert doc["latency_ms"]["tpot"]["count"] == 0
    assert doc["latency_ms"]["tpot"]["p50"] is None
    assert doc["latency_ms"]["ttft"]["count"] == 10


def test_same_seed_same_numbers_other_seed_differs(tmp_path: Path) -> None:
    """Two runs with the same seed give identical JSON (wall time aside); --seed changes it."""
    docs = []
    for name, extra in (("a", []), ("b", []), ("c", ["--seed", "7"])):
        out = tmp_path / f"{name}.json"
        argv = ["--config", GPT_OSS, "--hardware", "b200", "--workload", QUICK, "-q"]
        assert run_cli(*argv, "-o", str(out), *extra) == 0
        docs.append(json.loads(out.read_text()))
    a, b, c = docs
    assert without_wall_time(a) == without_wall_time(b)
    assert c["config"]["workload"]["seed"] == 7
    assert c["latency_ms"] != a["latency_ms"]


def test_seed_flag_equals_a_workload_with_that_seed(tmp_path: Path) -> None:
    """--seed N gives exactly the numbers of the same workload file with seed = N."""
    seeded = write(tmp_path / "q7.toml", Path(QUICK).read_text().replace("seed = 42", "seed = 7"))
    outs = []
    for workload, extra in ((QUICK, ["--seed", "7"]), (seeded, [])):
        out = tmp_path / f"{len(outs)}.json"
        argv = ["--config", GPT_OSS, "--hardware", "b200", "--workload", workload, "-q"]
        assert run_cli(*argv, "-o", str(out), *extra) == 0
        outs.append(json.loads(out.read_text()))
    assert outs[0]["latency_ms"] == outs[1]["latency_ms"]
    assert outs[0]["throughput"] == outs[1]["throughput"]


def test_subprocess_run_exits_zero_and_writes_json(tmp_path: Path) -> None:
    """The command runs as a process: exit 0, summary on stdout, JSON written."""
    out = tmp_path / "r.json"
    proc = subprocess.run(
        [sys.executable, "-m", "inference_lab.cli", "sim", "--config", GPT_OSS, "--hardware",
         "b200", "--workload", QUICK, "-o", str(out)],
        capture_output=True, text=True, timeout=120, cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "TTFT" in proc.stdout
    assert "Traceback" not in proc.stderr
    assert json.loads(out.read_text())["requests"]["completed"] == 50


def test_add_parser_registers_sim_and_types_its_flags() -> None:
    """`sim_cli.add_parser` adds a `sim` subcommand; `--seed` is an int, paths are Paths."""
    parser = argparse.ArgumentParser(prog="inference-lab")
    sub = parser.add_subparsers(dest="command", required=True)
    sim_cli.add_parser(sub)
    args = parser.parse_args(
        ["sim", "--config", GPT_OSS, "--workload", QUICK, "--seed", "3", "-q", "-o", "r.json"]
    )
    assert args.seed == 3 and args.quiet and args.hardware is None
    assert args.output == Path("r.json") and args.request_csv is None


def test_progress_callback_sees_requests_complete() -> None:
    """run_simulation reports progress: `done` never decreases and ends at every request."""
    seen: list[Progress] = []
    result = run_simulation(
        load_deployment(GPT_OSS, "b200"), load_workload(QUICK), progress=seen.append
    )
    assert seen, "no progress reported"
    done = [p.done for p in seen]
    assert done == sorted(done)
    assert seen[-1].done == 50 == len(result.finished)
    assert seen[-1].total == 50
    assert seen[-1].running == 0 and seen[-1].waiting == 0


def test_closed_loop_keeps_at_most_n_requests_in_flight(tmp_path: Path) -> None:
    """closed_loop: N users, each next request arrives exactly when a previous one finished,
    so no more than N requests are ever in flight and all num_requests complete."""
    wl = write(
        tmp_path / "closed.toml",
        'arrival_pattern = "closed_loop"\nnum_concurrent_users = 4\nclosed_loop_jitter_secs = 0.01\n'
        "num_requests = 30\n"
        'input_len_dist = { type = "uniform", min = 50, max = 400 }\n'
        'output_len_dist = { type = "uniform", min = 5, max = 60 }\nseed = 1\n',
    )
    result = run_simulation(load_deployment(GPT_OSS, "b200"), load_workload(wl))
    assert len(result.finished) == 30
    finish_times = {f.finish_time for f in result.finished}
    arrivals = sorted(f.arrival_time for f in result.finished)
    assert all(0 <= t < 0.01 for t in arrivals[:4])
    assert all(t in finish_times for t in arrivals[4:])
    events = sorted(
        [(f.arrival_time, 1) for f in result.finished]
        + [(f.finish_time, -1) for f in result.finished],
        key=lambda e: (e[0], e[1]),  # a finish at t frees its slot before the arrival at t
    )
    in_flight = peak = 0
    for _, delta in events:
        in_flight += delta
        peak = max(peak, in_flight)
    assert peak == 4


def test_requests_that_never_fit_are_refused_and_counted(tmp_path: Path) -> None:
    """A prompt over max_seq_len is refused at submit; the run goes on and counts it apart."""
    wl = write(
        tmp_path / "long.toml",
        'arrival_pattern = "uniform"\narrival_rate = 10.0\nnum_requests = 20\n'
        'input_len_dist = { type = "uniform", min = 7000, max = 9000 }\n'
        'output_len_dist = { type = "fixed", value = 200 }\nseed = 3\n',
    )
    csv_path = tmp_path / "r.csv"
    out = tmp_path / "r.json"
    argv = ["--config", LLAMA_70B, "--hardware", "b200", "--workload", wl, "-q"]
    assert run_cli(*argv, "-o", str(out), "--request-csv", str(csv_path)) == 0
    doc = json.loads(out.read_text())
    req = doc["requests"]
    assert req["refused"] > 0 and req["completed"] > 0
    assert req["refused"] + req["completed"] == req["submitted"] == 20
    assert doc["latency_ms"]["e2e"]["count"] == req["completed"]
    with csv_path.open(newline="") as fh:
        rows = list(csv.DictReader(fh))
    refused = [r for r in rows if r["status"] == "refused"]
    assert len(rows) == 20 and len(refused) == req["refused"]
    assert all(int(r["prompt_tokens"]) + 200 > 8192 for r in refused)
    assert all("max_seq_len" in r["refusal"] or "8192" in r["refusal"] for r in refused)


def test_closed_loop_where_everything_is_refused_terminates(tmp_path: Path) -> None:
    """A refused closed-loop user moves on to its next request; the run still ends."""
    wl = write(
        tmp_path / "never.toml",
        'arrival_pattern = "closed_loop"\nnum_concurrent_users = 3\nnum_requests = 12\n'
        'input_len_dist = { type = "fixed", value = 9000 }\n'
        'output_len_dist = { type = "fixed", value = 10 }\nseed = 3\n',
    )
    result = run_simulation(load_deployment(LLAMA_70B, "b200"), load_workload(wl))
    assert len(result.refused) == 12
    assert result.summary.requests_completed == 0


# ---------------------------------------------------------------------------------------
# bad input: one line on stderr, exit 1, no traceback


def assert_one_line_error(capsys: pytest.CaptureFixture[str], rc: int, *fragments: str) -> str:
    captured = capsys.readouterr()
    assert rc == 1
    lines = captured.err.splitlines()
    assert len(lines) == 1, captured.err
    assert lines[0].startswith("inference-lab sim: error: ")
    assert "Traceback" not in captured.err
    assert captured.out == ""
    for fragment in fragments:
        assert fragment in lines[0]
    return lines[0]


def test_missing_config_file(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """A config path that does not exist is a one-line error naming it."""
    missing = str(tmp_path / "nope.toml")
    rc = run_cli("--config", missing, "--workload", QUICK)
    assert_one_line_error(capsys, rc, "nope.toml")


def test_missing_workload_file(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """A workload path that does not exist is a one-line error naming it."""
    rc = run_cli("--config", GPT_OSS, "--hardware", "b200", "--workload", str(tmp_path / "w.toml"))
    assert_one_line_error(capsys, rc, "w.toml")


def test_unknown_key_in_config(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """A typo'd key in a model config is an error naming the file and key path."""
    text = Path(GPT_OSS).read_text().replace("[scheduler]\n", "[scheduler]\nmax_num_seq = 4\n")
    cfg = write(tmp_path / "typo.toml", text)
    rc = run_cli("--config", cfg, "--hardware", "b200", "--workload", QUICK)
    assert_one_line_error(capsys, rc, "typo.toml", "max_num_seq")


def test_unknown_key_in_workload(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """A typo'd key in a workload is an error naming the file and key."""
    wl = write(tmp_path / "w.toml", Path(QUICK).read_text() + "arival_rate = 3.0\n")
    rc = run_cli("--config", GPT_OSS, "--hardware", "b200", "--workload", wl)
    assert_one_line_error(capsys, rc, "w.toml", "arival_rate")


def test_unknown_hardware_entry(capsys: pytest.CaptureFixture[str]) -> None:
    """--hardware naming no entry of the config is an error naming the entry."""
    rc = run_cli("--config", GPT_OSS, "--hardware", "tpu", "--workload", QUICK)
    assert_one_line_error(capsys, rc, "tpu")


def test_without_hardware_several_entries_mean_b200(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """resources Rule 5, as in serve: without --hardware a config with several entries
    runs its b200 entry; several entries without b200 are an error listing them."""
    out = tmp_path / "r.json"
    assert run_cli("--config", GPT_OSS, "--workload", QUICK, "-q", "-o", str(out)) == 0
    assert json.loads(out.read_text())["config"]["hardware"] == "b200"
    capsys.readouterr()
    text = Path(GPT_OSS).read_text()
    text = text[: text.index("[hardware.b200]")] + text[text.index("[hardware.h200]") :]
    cfg = write(tmp_path / "no-b200.toml", text)
    rc = run_cli("--config", cfg, "--workload", QUICK)
    assert_one_line_error(capsys, rc, "h200", "gh200", "--hardware")


def test_single_entry_config_needs_no_hardware_flag(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """With exactly one [hardware.*] entry, --hardware may be omitted."""
    text = Path(GPT_OSS).read_text()
    text = text[: text.index("[hardware.b300]")]  # keep only [hardware.b200]
    cfg = write(tmp_path / "one.toml", text)
    rc = run_cli(
        "--config",
        cfg,
        "--workload",
        QUICK,
        "-q",
        "--profiles-dir",
        str(ROOT / "hardware_profiles"),
    )
    assert rc == 0
    assert "50 completed" in capsys.readouterr().out


def test_unwritable_output_fails_before_running(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """-o into a directory that does not exist is a one-line error, raised up front."""
    rc = run_cli(
        "--config", GPT_OSS, "--hardware", "b200", "--workload", QUICK,
        "-o", str(tmp_path / "no" / "such" / "r.json"),
    )  # fmt: skip
    assert_one_line_error(capsys, rc, "does not exist")


def test_a_workload_without_seed_is_seeded_with_0(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """``seed`` may be left out of a workload (docs/configuration.md: default 0): the run
    is the one ``seed = 0`` gives, and the configuration print says so."""
    text = Path(QUICK).read_text()
    assert "seed = 42" in text
    without = write(tmp_path / "noseed.toml", text.replace("seed = 42", ""))
    zero = write(tmp_path / "zero.toml", text.replace("seed = 42", "seed = 0"))
    outs = []
    for workload in (without, zero):
        out = tmp_path / f"{Path(workload).stem}.json"
        assert run_cli("--config", GPT_OSS, "--workload", workload, "-o", str(out)) == 0
        doc = without_wall_time(json.loads(out.read_text()))
        assert doc.pop("config")["workload"]["seed"] == 0
        outs.append(doc)
        assert ", seed 0" in capsys.readouterr().out
    assert outs[0] == outs[1]


def test_subprocess_error_is_one_line_exit_1(tmp_path: Path) -> None:
    """As a process, bad input exits 1 with exactly one stderr line and no traceback."""
    proc = subprocess.run(
        [sys.executable, "-m", "inference_lab.cli", "sim", "--config", GPT_OSS, "--workload",
         QUICK, "--hardware", "tpu"],
        capture_output=True, text=True, timeout=60, cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 1
    assert len(proc.stderr.splitlines()) == 1
    assert proc.stderr.startswith("inference-lab sim: error: ")


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        (["--seed", "-1"], "argument --seed: must be an integer >= 0, got -1"),
        (["--seed", "x"], "argument --seed: must be an integer >= 0, got 'x'"),
        (["--no-such-flag"], "unrecognized arguments: --no-such-flag"),
    ],
)
def test_bad_flags_are_one_line_usage_errors(
    argv: list[str], fragment: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A flag value out of range (`--seed -1` once reached numpy and printed a traceback),
    of the wrong type, or an unknown flag is a usage error: one line, exit 2, before any
    file is read."""
    rc = run_cli("--config", "missing.toml", "--workload", "missing.toml", *argv)
    captured = capsys.readouterr()
    assert rc == 2
    assert captured.err.splitlines() == [f"inference-lab sim: error: {fragment}"]
    assert captured.out == ""


# ---------------------------------------------------------------------------------------
# shipped files by name, scheduler overrides


def test_config_and_workload_are_found_by_name_from_any_directory(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`--config gpt-oss-20b --workload quick` from a directory without `configs/` runs the
    shipped files (after `pip install` there is no `configs/` to point at); the config
    print names the files found."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("INFERENCE_LAB_HARDWARE_PROFILES", raising=False)
    rc = run_cli("--config", "gpt-oss-20b", "--hardware", "b200", "--workload", "quick.toml")
    out = capsys.readouterr().out
    assert rc == 0 and "50 completed" in out
    assert f"({CONFIGS / 'gpt-oss-20b.toml'})" in out
    assert str(CONFIGS / "workloads" / "quick.toml") in out


def test_a_file_in_the_working_directory_wins_over_a_shipped_name(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A path that exists is always a path: a local file called `quick` is the workload,
    not the shipped `quick.toml`."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "quick").write_text(Path(QUICK).read_text().replace("= 50", "= 7"))
    rc = run_cli("--config", GPT_OSS, "--hardware", "b200", "--workload", "quick", "-q")
    assert rc == 0 and "7 completed" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("flag", "name", "listed"),
    [
        ("--config", "gpt-oss-2b", "gpt-oss-20b, gpt-oss-120b"),
        ("--workload", "quik", "chat-closed-64, chat-poisson-5rps"),
    ],
)
def test_an_unknown_name_is_one_line_listing_the_shipped_names(
    flag: str, name: str, listed: str, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """A bare name that is neither a file nor a shipped file: one line naming the flag and
    every shipped name, exit 1."""
    argv = {"--config": GPT_OSS, "--workload": QUICK, flag: name}
    rc = run_cli(
        "--config", argv["--config"], "--hardware", "b200", "--workload", argv["--workload"]
    )
    line = assert_one_line_error(capsys, rc, f"{flag} {name}: no such file")
    shipped = shipped_names("config" if flag == "--config" else "workload")
    assert line.endswith(f"s: {', '.join(shipped)})")
    for item in listed.split(", "):
        assert item in line
    assert "; did you mean " in line


def test_max_num_seqs_and_max_waiting_override_the_config(tmp_path: Path) -> None:
    """`--max-num-seqs 2` caps the batch (16 closed-loop users: 14 wait) and
    `--max-waiting` is in force; both show in the configuration and the JSON."""
    wl = write(
        tmp_path / "closed.toml",
        'arrival_pattern = "closed_loop"\nnum_concurrent_users = 16\nnum_requests = 64\n'
        "closed_loop_jitter_secs = 0.01\n"
        'input_len_dist = { type = "fixed", value = 100 }\n'
        'output_len_dist = { type = "fixed", value = 20 }\nseed = 1\n',
    )
    out = tmp_path / "r.json"
    argv = ["--config", GPT_OSS, "--hardware", "b200", "--workload", wl, "-q", "-o", str(out)]
    assert run_cli(*argv, "--max-num-seqs", "2") == 0
    doc = json.loads(out.read_text())
    assert doc["config"]["scheduler"]["max_num_seqs"] == 2
    assert doc["peak_waiting"] == 14 and doc["requests"]["refused"] == 0
    assert run_cli(*argv, "--max-num-seqs", "2", "--max-waiting", "4") == 0
    doc = json.loads(out.read_text())
    assert doc["config"]["scheduler"]["max_waiting"] == 4
    assert doc["peak_waiting"] == 4 and doc["requests"]["refused"] > 0


def test_max_waiting_refuses_arrivals_that_find_the_queue_full(tmp_path: Path) -> None:
    """As serve's admission: an arrival with no seat that finds `max_waiting` waiting
    places taken is refused (limit `max_waiting`) and never runs; the queue never holds
    more than the seats and the places; every other arrival completes."""
    wl = write(
        tmp_path / "burst.toml",
        'arrival_pattern = "uniform"\narrival_rate = 400.0\nnum_requests = 300\n'
        'input_len_dist = { type = "fixed", value = 200 }\n'
        'output_len_dist = { type = "fixed", value = 100 }\nseed = 1\n',
    )
    dep = override_scheduler(load_deployment(GPT_OSS, "b200"), max_num_seqs=4, max_waiting=3)
    result = run_simulation(dep, load_workload(wl))
    queue_refused = [r for r in result.refused if r.limit == "max_waiting"]
    assert queue_refused and len(queue_refused) == len(result.refused)
    assert all(r.reason == "3 waiting (max_waiting = 3)" for r in queue_refused)
    assert len(result.finished) + len(queue_refused) == 300
    assert 3 <= result.peak_waiting <= 3 + 4
    assert f"({len(queue_refused):,} by max_waiting)" in format_summary(result)


def test_a_closed_loop_user_refused_by_max_waiting_retries_at_the_next_completion(
    tmp_path: Path,
) -> None:
    """A closed-loop user turned away by the bound sends its next request when the next
    request finishes, never at the same instant: the run ends and every arrival after the
    first round is at a completion time."""
    wl = write(
        tmp_path / "closed.toml",
        'arrival_pattern = "closed_loop"\nnum_concurrent_users = 10\nnum_requests = 200\n'
        'input_len_dist = { type = "fixed", value = 100 }\n'
        'output_len_dist = { type = "fixed", value = 20 }\nseed = 1\n',
    )
    dep = override_scheduler(load_deployment(GPT_OSS, "b200"), max_num_seqs=2, max_waiting=3)
    result = run_simulation(dep, load_workload(wl))
    assert result.refused and all(r.limit == "max_waiting" for r in result.refused)
    assert len(result.finished) + len(result.refused) == 200
    finish_times = {f.finish_time for f in result.finished}
    later = [r.arrival.time for r in result.refused if r.arrival.time > 0]
    later += [f.arrival_time for f in result.finished if f.arrival_time > 0]
    assert later and all(t in finish_times for t in later)
    assert 3 <= result.peak_waiting <= 3 + 2


def test_a_burst_in_the_simulator_admits_seats_plus_places(tmp_path: Path) -> None:
    """Ten simultaneous arrivals into max_num_seqs 2 / max_waiting 3: exactly five are
    admitted (two seats, three places), as serve admits them."""
    wl = write(
        tmp_path / "batched.toml",
        'arrival_pattern = "batched"\nnum_requests = 10\n'
        'input_len_dist = { type = "fixed", value = 100 }\n'
        'output_len_dist = { type = "fixed", value = 20 }\nseed = 1\n',
    )
    dep = override_scheduler(load_deployment(GPT_OSS, "b200"), max_num_seqs=2, max_waiting=3)
    result = run_simulation(dep, load_workload(wl))
    assert (len(result.finished), len(result.refused)) == (5, 5)
    assert {r.reason for r in result.refused} == {"3 waiting (max_waiting = 3)"}


def test_a_frontend_latency_is_shown_and_counted_from_the_arrival(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`[scheduler] frontend_latency` (engine Rule 7) on an open loop fed lazily: the
    configuration print names it, every request keeps its arrival time, and its queue
    time and TTFT include the latency."""
    text = Path(GPT_OSS).read_text()
    config = write(
        tmp_path / "gpt.toml",
        text.replace("[scheduler]\n", "[scheduler]\nfrontend_latency = 0.005\n"),
    )
    rows = []
    for cfg in (GPT_OSS, config):
        path = tmp_path / f"{len(rows)}.csv"
        rc = run_cli(
            "--config", cfg, "--hardware", "b200", "--workload", QUICK, "--request-csv", str(path)
        )  # fmt: skip
        assert rc == 0
        with path.open(newline="") as fh:
            rows.append(list(csv.DictReader(fh)))
    assert "frontend latency 5 ms" in capsys.readouterr().out
    plain, delayed = rows
    assert [r["arrival_time_s"] for r in delayed] == [r["arrival_time_s"] for r in plain]
    assert min(float(r["queue_ms"]) for r in delayed) >= 5.0 - 1e-9
    assert min(float(r["queue_ms"]) for r in plain) < 5.0
