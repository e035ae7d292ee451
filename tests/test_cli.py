"""The ``inference-lab`` command as a whole: which modules a subcommand loads, the exit-code
policy of ``cli.py`` (0 / 1 / 2 / 130, one line each), and the flag toolkit every
subcommand validates with (``cli_args``)."""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import subprocess
import sys
from pathlib import Path

import pytest

from inference_lab import cli, cli_args
from inference_lab.cli_args import check_output, integer, number, parse_int
from inference_lab.sim import cli as sim_cli

ROOT = Path(__file__).resolve().parent.parent
GPT_OSS = str(ROOT / "configs" / "gpt-oss-20b.toml")
QUICK = str(ROOT / "configs" / "workloads" / "quick.toml")
SERVE_STACK = {"trio", "quart", "quart_trio", "hypercorn"}


def loaded_after(argv: list[str]) -> tuple[int, set[str], str]:
    """Run ``cli.main(argv)`` in a fresh interpreter; return its exit code, the top-level
    packages and ``inference_lab`` modules it had imported, and its stdout."""
    script = (
        "import json, sys\n"
        "from inference_lab.cli import main\n"
        f"rc = main({argv!r})\n"
        "names = {m.split('.')[0] for m in sys.modules}\n"
        "names |= {m for m in sys.modules if m.startswith('inference_lab.')}\n"
        "print(json.dumps([rc, sorted(names)]))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert proc.returncode == 0, proc.stderr
    *out, last = proc.stdout.strip().splitlines()
    rc, names = json.loads(last)
    return rc, set(names), "\n".join(out)


# -- what a subcommand loads -------------------------------------------------------------


def test_sim_does_not_import_the_serve_stack() -> None:
    """A whole ``inference-lab sim`` run loads neither trio, quart nor hypercorn, nor the
    modules of the other subcommands."""
    argv = ["sim", "--config", GPT_OSS, "--hardware", "b200", "--workload", QUICK, "-q"]
    rc, loaded, out = loaded_after(argv)
    assert rc == 0 and "50 completed" in out
    assert not loaded & SERVE_STACK, loaded & SERVE_STACK
    assert not {"inference_lab.serve.cli", "inference_lab.client"} & loaded


@pytest.mark.parametrize(
    "argv", [["--help"], ["sim", "--help"], ["load", "--help"], ["calibrate", "--help"]]
)
def test_parsing_loads_no_machinery(argv: list[str]) -> None:
    """The top-level help and the ``sim``, ``load`` and ``calibrate`` parsers answer without
    numpy, trio or the engine: a subcommand's machinery is imported only when it runs."""
    rc, loaded, out = loaded_after(argv)
    assert rc == 0 and "usage: inference-lab" in out
    assert not loaded & (SERVE_STACK | {"numpy", "cattrs"}), loaded & (SERVE_STACK | {"numpy"})
    assert "inference_lab.core.engine" not in loaded and "inference_lab.sim.run" not in loaded


def test_top_level_help_lists_every_subcommand(capsys: pytest.CaptureFixture[str]) -> None:
    """``inference-lab --help`` names every subcommand with its summary."""
    assert cli.main(["--help"]) == 0
    # argparse wraps the summaries, at spaces and after hyphens
    out = " ".join(capsys.readouterr().out.split()).replace("- ", "-")
    for name, (_, summary) in cli.SUBCOMMANDS.items():
        assert name in out and summary in out


def test_version_prints_the_installed_version(capsys: pytest.CaptureFixture[str]) -> None:
    """``inference-lab --version`` prints the distribution's version and exits 0, without
    a subcommand and without loading any subcommand's machinery."""
    assert cli.main(["--version"]) == 0
    captured = capsys.readouterr()
    assert captured.out == f"inference-lab {importlib.metadata.version('inference-lab')}\n"
    assert captured.err == ""
    rc, loaded, out = loaded_after(["--version"])
    assert rc == 0 and out.startswith("inference-lab ")
    assert not loaded & (SERVE_STACK | {"numpy", "cattrs"})


# -- exit codes --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "line"),
    [
        (["bogus"], "inference-lab: error: argument {sim,serve,load,plan,calibrate,proxy}: invalid choice: 'bogus'"),
        (["sim"], "inference-lab sim: error: the following arguments are required: --config"),
        (["load", "--url", "http://h", "--model", "m", "--requests", "1", "--rate", "nan"],
         "inference-lab load: error: argument --rate: must be a number > 0, got nan"),
        (["serve", "--port", "70000"],
         "inference-lab serve: error: argument --port: must be an integer in 0..65535, got 70000"),
        (["serve", "--max-num-seqs", "0"],
         "inference-lab serve: error: argument --max-num-seqs: must be an integer >= 1, got 0"),
        (["serve", "--max-waiting", "-1"],
         "inference-lab serve: error: argument --max-waiting: must be an integer >= 0, got -1"),
        (["serve", "--seed", "-2"],
         "inference-lab serve: error: argument --seed: must be an integer >= 0, got -2"),
        (["serve", "--default-max-tokens", "x"],
         "inference-lab serve: error: argument --default-max-tokens: must be an integer >= 1, "
         "got 'x'"),
        (["serve", "--bogus"], "inference-lab serve: error: unrecognized arguments: --bogus"),
    ],
)  # fmt: skip
def test_usage_errors_are_one_line_and_exit_2(
    argv: list[str], line: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A wrong command line, in any subcommand, is one line naming the subcommand, exit 2,
    before anything runs."""
    assert cli.main(argv) == 2
    captured = capsys.readouterr()
    assert len(captured.err.splitlines()) == 1, captured.err
    assert captured.err.startswith(line) and captured.out == ""


def test_bare_command_prints_the_help_and_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    """``inference-lab`` alone prints the whole help (every subcommand with its summary) on
    stderr and exits 2, as a command line without its subcommand is a usage error."""
    assert cli.main([]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("usage: inference-lab")
    err = " ".join(captured.err.split()).replace("- ", "-")
    for name, (_, summary) in cli.SUBCOMMANDS.items():
        assert name in err and summary in err


def test_python_dash_m_runs_the_command() -> None:
    """``python -m inference_lab`` is the command: its help, its exit codes."""
    proc = subprocess.run(
        [sys.executable, "-m", "inference_lab", "--help"],
        capture_output=True, text=True, timeout=60, cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode == 0 and proc.stdout.startswith("usage: inference-lab")
    proc = subprocess.run(
        [sys.executable, "-m", "inference_lab", "sim", "--seed", "-1"],
        capture_output=True, text=True, timeout=60, cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == [
        "inference-lab sim: error: argument --seed: must be an integer >= 0, got -1"
    ]


@pytest.mark.parametrize(
    "argv",
    [
        ["sim", "--config", "{bad}", "--workload", QUICK],
        ["sim", "--config", GPT_OSS, "--workload", "{bad}"],
        ["serve", "--config", "{bad}", "--port", "0"],
        ["serve", "--config", GPT_OSS, "--workload", "{bad}", "--port", "0"],
        ["plan", "{bad}", "--out-dir", "{tmp}/out"],
        ["calibrate", "--config", "{bad}", QUICK],
    ],
    ids=["sim-config", "sim-workload", "serve-config", "serve-workload", "plan", "calibrate"],
)
def test_a_file_that_is_not_utf8_is_one_line_naming_it(
    argv: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A config, workload or spec that is not UTF-8 (here Latin-1 text) is the one-line
    error every other bad file gets, naming the file and the first bad byte, exit 1: no
    UnicodeDecodeError traceback."""
    bad = tmp_path / "latin1.toml"
    bad.write_bytes('[model]\nname = "caf\u00e9"\n'.encode("latin-1"))
    args = [a.format(bad=bad, tmp=tmp_path) for a in argv]
    assert cli.main(args) == 1
    captured = capsys.readouterr()
    (line,) = captured.err.splitlines()
    assert line.startswith(f"inference-lab {argv[0]}: error: {bad}: not UTF-8 text")
    assert "byte 0xe9 at offset 19" in line and "Traceback" not in captured.err


def test_serve_flags_are_parsed_to_integers() -> None:
    """``serve``'s integer flags arrive as ints, with the documented defaults."""
    parser, chosen = cli.build_parser("serve")
    args = parser.parse_args(["serve", "--max-waiting", "0", "--seed", "3"])
    assert (args.port, args.default_max_tokens, args.max_waiting, args.seed) == (8080, 256, 0, 3)
    assert args.max_num_seqs is None and chosen is not None and chosen.prog.endswith("serve")


def test_run_time_errors_exit_1(capsys: pytest.CaptureFixture[str]) -> None:
    """A well-formed command that cannot run (here: an unknown hardware entry) exits 1."""
    argv = ["sim", "--config", GPT_OSS, "--hardware", "tpu", "--workload", QUICK]
    assert cli.main(argv) == 1
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("inference-lab sim: error: ") and "tpu" in line


def test_ctrl_c_exits_130_with_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A KeyboardInterrupt out of a subcommand is exit 130 and one line, no traceback."""

    def interrupted(args: argparse.Namespace) -> int:
        raise KeyboardInterrupt

    monkeypatch.setattr(sim_cli, "run", interrupted)
    assert cli.main(["sim", "--config", GPT_OSS, "--workload", QUICK]) == 130
    assert capsys.readouterr().err == "inference-lab sim: interrupted\n"


def test_console_script_exit_code_is_mains() -> None:
    """``python -m inference_lab.cli`` exits with ``main``'s code (2 for a usage error)."""
    proc = subprocess.run(
        [sys.executable, "-m", "inference_lab.cli", "sim", "--seed", "-1"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == [
        "inference-lab sim: error: argument --seed: must be an integer >= 0, got -1"
    ]


# -- the toolkit -------------------------------------------------------------------------


def test_parse_int_bounds_and_messages() -> None:
    """Integers within the bounds pass; others raise ValueError with the tail of a one-line
    message (the wording serve's environment variables share)."""
    assert parse_int("7", ge=0) == 7 and parse_int("-3") == -3 and parse_int("9", le=9) == 9
    with pytest.raises(ValueError, match=r"^must be an integer >= 1, got 0$"):
        parse_int("0", ge=1)
    with pytest.raises(ValueError, match=r"^must be an integer in 0\.\.10, got 11$"):
        parse_int("11", ge=0, le=10)
    with pytest.raises(ValueError, match=r"^must be an integer <= 5, got '2\.5'$"):
        parse_int("2.5", le=5)


def test_integer_and_number_types() -> None:
    """The argparse types accept what is in range and refuse the rest with an
    ArgumentTypeError (argparse turns it into the usage error)."""
    assert integer(ge=1)("3") == 3
    assert number(gt=0, lt=1)("0.5") == 0.5 and number(ge=0)("0") == 0.0
    for parse, text in (
        (integer(ge=1), "0"),
        (integer(), "1e3"),
        (number(gt=0), "0"),
        (number(gt=0, lt=1), "1"),
        (number(), "inf"),
        (number(), "nan"),
        (number(), "x"),
    ):
        with pytest.raises(argparse.ArgumentTypeError):
            parse(text)


def test_check_output_refuses_what_cannot_be_created(tmp_path: Path) -> None:
    """An output path in a missing directory, or a directory itself, is refused with a line
    naming the flag; a new file in an existing directory and None pass."""
    check_output("-o", tmp_path / "new.json")
    check_output("-o", None)
    with pytest.raises(ValueError, match=r"^-o .*missing.*: directory .* does not exist$"):
        check_output("-o", tmp_path / "missing" / "r.json")
    with pytest.raises(ValueError, match=r"^--csv .*: is a directory$"):
        check_output("--csv", tmp_path)


def test_fail_prints_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    """``fail`` prints only the first line of a message and returns the code."""
    assert cli_args.fail("inference-lab x", "first\nsecond") == cli_args.EXIT_ERROR
    assert cli_args.fail("inference-lab x", "bad", cli_args.EXIT_USAGE) == 2
    assert capsys.readouterr().err.splitlines() == [
        "inference-lab x: error: first",
        "inference-lab x: error: bad",
    ]
