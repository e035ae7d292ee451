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

from inference_lab.resources import shipped_dir

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


def test_installed_wheel_serves_its_shipped_configs_from_anywhere(
    wheel: Path, tmp_path: Path
) -> None:
    """Installed outside the checkout and run from an unrelated directory, the package
    finds its own configs and profiles (not the checkout's) and a simulation of a shipped
    config and workload, named as ``--config gpt-oss-20b --workload quick``, runs on them."""
    site = tmp_path / "site"
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "--quiet",
         "--target", str(site), str(wheel)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = dict(os.environ, PYTHONPATH=str(site))
    env.pop("INFERENCE_LAB_HARDWARE_PROFILES", None)
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
    proc = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True, text=True, timeout=120, cwd=elsewhere, env=env,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    package, configs, profiles = proc.stdout.splitlines()[:3]
    installed = site.resolve() / "inference_lab"
    assert Path(package).parent == installed
    assert Path(configs) == installed / "configs"
    assert Path(profiles) == installed / "hardware_profiles"
    assert "50 completed" in proc.stdout


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
