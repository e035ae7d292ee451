"""The package as a user installs it: a built wheel carries every module, the shipped model
configs, workloads and hardware profiles, and ``resources.shipped_dir`` finds them from any
working directory, in the checkout and in an installed wheel.

The wheel is built offline from a copy of the sources (``pip wheel --no-build-isolation
--no-index``, setuptools from the ``test`` extra), so the checkout gets no ``build/``.
"""

from __future__ import annotations

import email.parser
import os
import re
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from inference_lab.errors import ConfigError
from inference_lab.resources import (
    SHIPPED,
    did_you_mean,
    resolve_shipped,
    shipped_dir,
    shipped_files,
    shipped_names,
)

ROOT = Path(__file__).resolve().parent.parent
SOURCES = ("pyproject.toml", "README.md", "inference_lab", "configs", "hardware_profiles")


def _shipped(kind: str) -> set[str]:
    """The wheel paths the checkout's ``kind`` directory must become."""
    base = ROOT / kind
    return {f"inference_lab/{kind}/{p.relative_to(base).as_posix()}" for p in base.rglob("*.toml")}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    src = tmp_path_factory.mktemp("src")
    for name in SOURCES:
        path = ROOT / name
        if path.is_dir():
            shutil.copytree(path, src / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(path, src / name)
    out = tmp_path_factory.mktemp("dist")
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
         "--no-index", "--quiet", "-w", str(out), str(src)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    (path,) = out.glob("inference_lab-*.whl")
    yield path


def test_wheel_holds_every_module_and_the_shipped_data(wheel: Path) -> None:
    """Every module of the package (a subpackage missing from pyproject's list would be
    left out), every shipped config and workload, and every hardware profile are in the
    wheel, the data under ``inference_lab/``."""
    names = set(zipfile.ZipFile(wheel).namelist())
    modules = {
        p.relative_to(ROOT).as_posix()
        for p in (ROOT / "inference_lab").rglob("*.py")
        if "__pycache__" not in p.parts
    }
    assert modules <= names, sorted(modules - names)
    for kind in ("configs", "hardware_profiles"):
        expected = _shipped(kind)
        assert expected and expected <= names, sorted(expected - names)
    assert "inference_lab/configs/workloads/quick.toml" in names
    # the pages' parts and the vendored chart library with its licence
    web = {p.name for p in (ROOT / "inference_lab" / "web").iterdir() if p.suffix != ".py"}
    web.discard("__pycache__")
    assert {"uPlot.iife.min.js", "uPlot.LICENSE", "dashboard.html", "report.html"} <= web
    assert {f"inference_lab/web/{n}" for n in web} <= names
    assert "inference_lab/plan/prices.toml" in names  # the planner's price table


def test_wheel_metadata_bounds_the_server_stack_and_makes_plotting_optional(
    wheel: Path,
) -> None:
    """hypercorn and quart-trio are bounded above; matplotlib is only in the ``plot`` extra
    and Ray only in the ``ray`` extra."""
    with zipfile.ZipFile(wheel) as z:
        (meta,) = [n for n in z.namelist() if n.endswith(".dist-info/METADATA")]
        message = email.parser.Parser().parsestr(z.read(meta).decode())
    requires = message.get_all("Requires-Dist") or []
    by_name = {r.split(";")[0].split("<")[0].split(">")[0].strip().lower(): r for r in requires}
    assert "<" in by_name["hypercorn"] and "<" in by_name["quart-trio"]
    matplotlib = [r for r in requires if r.lower().startswith("matplotlib")]
    assert matplotlib and all('extra == "plot"' in r for r in matplotlib)
    ray = [r for r in requires if r.lower().startswith("ray")]  # plan --ray: optional too
    assert ray and all('extra == "ray"' in r for r in ray)


@pytest.fixture(scope="module")
def installed(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The wheel installed outside the checkout: its site directory, and an unrelated
    empty working directory."""
    site = tmp_path_factory.mktemp("site")
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "--quiet",
         "--target", str(site), str(wheel)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return site, tmp_path_factory.mktemp("elsewhere")


def _run_installed(installed: tuple[Path, Path], script: str) -> subprocess.CompletedProcess[str]:
    site, elsewhere = installed
    env = dict(os.environ, PYTHONPATH=str(site))
    env.pop("INFERENCE_LAB_HARDWARE_PROFILES", None)
    return subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True, text=True, timeout=120, cwd=elsewhere, env=env,
    )  # fmt: skip


def test_installed_wheel_serves_its_shipped_configs_from_anywhere(
    installed: tuple[Path, Path],
) -> None:
    """Installed outside the checkout and run from an unrelated directory, the package
    finds its own configs and profiles (not the checkout's) and a simulation of a shipped
    config and workload, named as ``--config gpt-oss-20b --workload quick``, runs on them."""
    script = (
        "import inference_lab, sys\n"
        "from inference_lab.resources import shipped_dir\n"
        "from inference_lab.cli import main\n"
        "print(inference_lab.__file__)\n"
        "print(shipped_dir('configs'))\n"
        "print(shipped_dir('hardware_profiles'))\n"
        "sys.exit(main(['sim', '--config', 'gpt-oss-20b', '--hardware', 'b200',\n"
        "               '--workload', 'quick', '-q']))\n"
    )
    proc = _run_installed(installed, script)
    assert proc.returncode == 0, proc.stderr
    package, configs, profiles = proc.stdout.splitlines()[:3]
    installed_package = installed[0].resolve() / "inference_lab"
    assert Path(package).parent == installed_package
    assert Path(configs) == installed_package / "configs"
    assert Path(profiles) == installed_package / "hardware_profiles"
    assert "50 completed" in proc.stdout


def test_installed_wheel_names_its_plans_traces_and_frontier_configs(
    installed: tuple[Path, Path],
) -> None:
    """From the wheel, the README's ``plan configs/plans/chat-20rps.toml`` is
    ``plan chat-20rps``: the spec and every file it names load from the package (its 30
    candidates); a frontier config and a trace are named as the main configs are
    (``sim --config Llama-3.1-8B-Instruct-EAGLE --trace mooncake-sample``)."""
    script = (
        "import sys\n"
        "from inference_lab.cli import main\n"
        "from inference_lab.plan.spec import expand_candidates, load_spec\n"
        "from inference_lab.resources import resolve_shipped\n"
        "spec = load_spec(resolve_shipped('chat-20rps', 'plan', 'SPEC'))\n"
        "print(len(expand_candidates(spec)), spec.workload_path)\n"
        "sys.exit(main(['sim', '--config', 'Llama-3.1-8B-Instruct-EAGLE', '--hardware',\n"
        "               'h100', '--trace', 'mooncake-sample', '-q']))\n"
    )
    proc = _run_installed(installed, script)
    assert proc.returncode == 0, proc.stderr
    count, workload = proc.stdout.splitlines()[0].split()
    assert count == "30"
    assert (
        Path(workload)
        == installed[0].resolve() / "inference_lab/configs/workloads/chat-poisson-5rps.toml"
    )
    assert "24 completed" in proc.stdout


def test_every_shipped_name_resolves_to_a_file_that_loads() -> None:
    """Rule 3 of ``resources``: each kind's names are its folders' file stems, unique
    within the kind, and the file a name resolves to loads (a config, a workload, a trace,
    a plan spec with everything it names)."""
    from inference_lab.core.config import load_model_config, load_workload
    from inference_lab.plan.spec import load_spec
    from inference_lab.traffic.traces import detect_format

    configs = ROOT / "configs"
    for kind, (folders, suffixes) in SHIPPED.items():
        files = [
            p
            for folder in folders
            for p in (configs / folder).iterdir()
            if p.suffix in suffixes and p.is_file()
        ]
        assert files and len({p.stem for p in files}) == len(files), kind
        assert set(shipped_names(kind)) == {p.stem for p in files}
        for name, path in shipped_files(kind).items():
            assert resolve_shipped(name, kind, "--x") == path
            assert resolve_shipped(path.name, kind, "--x") == path
    assert {"DeepSeek-V3", "Llama-3.3-70B-Instruct-FP8", "gpt-oss-20b"} <= set(
        shipped_names("config")
    )
    for path in shipped_files("config").values():
        load_model_config(path)
    for path in shipped_files("workload").values():
        load_workload(path)
    for path in shipped_files("trace").values():
        detect_format(path)
    for path in shipped_files("plan").values():
        load_spec(path)


@pytest.mark.parametrize(
    ("kind", "typed", "hint"),
    [
        ("config", "gpt-oss-2b", "did you mean gpt-oss-20b or gpt-oss-120b?"),
        ("config", "deepseek-v3", "did you mean DeepSeek-V3 or DeepSeek-R1"),
        ("workload", "quik", "did you mean quick?"),
        ("trace", "mooncake", "did you mean mooncake-sample?"),
        ("plan", "chat-20-rps", "did you mean chat-20rps?"),
    ],
)
def test_a_mistyped_shipped_name_gets_did_you_mean(kind: str, typed: str, hint: str) -> None:
    """Rule 4: the closest names come first, then every shipped name; one line."""
    with pytest.raises(ConfigError) as info:
        resolve_shipped(typed, kind, "--flag")  # type: ignore[arg-type]
    message = str(info.value)
    assert "\n" not in message and message.startswith(f"--flag {typed}: no such file")
    assert hint in message
    assert message.endswith(", ".join(shipped_names(kind)) + ")")  # type: ignore[arg-type]
    assert did_you_mean("zzzzzz", ["quick"]) == []


def test_checkout_resources_are_found_from_another_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """In the checkout, ``shipped_dir`` names the top-level directories whatever the
    working directory."""
    monkeypatch.chdir(tmp_path)
    assert shipped_dir("configs") == ROOT / "configs"
    assert shipped_dir("hardware_profiles") == ROOT / "hardware_profiles"
    assert (shipped_dir("configs") / "workloads" / "quick.toml").is_file()


#: Flags of the example commands that name a file the command writes.
_OUTPUT_FLAG = re.compile(
    r"(?:^|[\s\[`])(?:-o|--output|--csv|--plot|--request-csv)\s+([\w./-]+)|path=([\w./-]+)"
)


def _example_outputs() -> set[str]:
    """The files the README's and the user docs' example commands write (metavars such as
    ``PATH`` and directories left out)."""
    found: set[str] = set()
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for match in _OUTPUT_FLAG.finditer(page.read_text()):
            name = match.group(1) or match.group(2)
            if name and not name.isupper() and not name.endswith("/") and "." in name:
                found.add(name)
    return found


def test_what_building_and_the_examples_write_is_ignored_by_git() -> None:
    """``build/``, ``dist/`` and every file an example command of the README or the docs
    writes (``-o result.json``, ``--plot aimd.png``, ...) are ignored, so trying the
    examples in a checkout leaves ``git status`` clean."""
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    outputs = _example_outputs()
    assert {"result.json", "aimd.png", "requests.csv"} <= outputs, outputs
    paths = sorted(outputs | {"build/x.whl", "dist/x.whl"})
    proc = subprocess.run(
        ["git", "check-ignore", "--no-index", "--verbose", "--non-matching", *paths],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    not_ignored = [
        line.split("\t")[-1] for line in proc.stdout.splitlines() if line.startswith("::")
    ]
    assert not_ignored == [], not_ignored
