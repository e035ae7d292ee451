"""Every shipped deployment (each hardware entry of each model config under ``configs/``)
runs the common workload through ``run_until`` exactly as ``step()`` runs it one event at
a time: the same steps, completions, state and events (``test_engine_crossing``'s driver,
its runs crossing arrivals, with aborts and late submissions between cutoffs).

The scenario tests exercise each engine path on a few chosen deployments; this one meets
the paths a shipped deployment's own shape takes (MLA classes on one node, a calibrated
profile's host terms, a pooling model), where a fast path that assumes a shape raises or
drifts. A decode run's lean admission once priced an MLA model's step without its MLA
sums and raised on every DeepSeek-R1 entry at 60 requests/s; this test fails on that.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from inference_lab.core.config import Deployment, load_model_config
from tests.engine_util import ROOT
from tests.test_engine_crossing import _drive
from tests.test_engine_runs import _same, _specs

PROFILES = ROOT / "hardware_profiles"
CONFIGS = sorted(
    [*(ROOT / "configs").glob("*.toml")]
    + [
        p
        for d in ("fidelity", "frontier", "pooling")
        for p in (ROOT / "configs" / d).glob("*.toml")
    ]
)


def _deployments() -> list[tuple[str, Path, str]]:
    out = []
    for path in CONFIGS:
        for entry in load_model_config(path, PROFILES).deployments:
            out.append((f"{path.parent.name}/{path.stem}:{entry}", path, entry))
    return out


SHIPPED = _deployments()


def _deployment(path: Path, entry: str) -> Deployment:
    return load_model_config(path, PROFILES).deployments[entry]


def test_every_model_config_is_covered() -> None:
    """The list above is every model config the repository ships (the plans and
    workloads directories hold other files)."""
    shipped = {p for p in (ROOT / "configs").rglob("*.toml")}
    others = {p for p in shipped if p.parent.name in ("plans", "workloads")}
    assert set(CONFIGS) == shipped - others
    assert len(SHIPPED) > len(CONFIGS)


@pytest.mark.parametrize(("name", "path", "entry"), SHIPPED, ids=[s[0] for s in SHIPPED])
def test_a_shipped_deployment_runs_as_step_by_step(name: str, path: Path, entry: str) -> None:
    """The bench mix (lognormal prompts around 1,000 tokens, outputs around 200) at 60
    requests/s, 120 requests: the same figures both ways, and some requests complete."""
    dep = _deployment(path, entry)
    specs = _specs(120, 7, rate=60.0, prompt_mu=6.9, output_mu=5.3)
    stepped = _drive(dep, specs, 7, runs=False)
    ran = _drive(dep, specs, 7, runs=True)
    _same(stepped[:4], ran[:4])  # type: ignore[arg-type]
    assert stepped[4] == ran[4]
    assert stepped[1], name
