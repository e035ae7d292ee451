"""The efficiency terms of the step model: achievable bandwidth and FLOP/s fractions and a
fixed per-step overhead (per profile, overridable per entry), layered profiles (``base``)
and entries naming their profile. The defaults must price exactly as the datasheet
roofline does."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from inference_lab.core.config import Deployment, load_deployment, load_model_config
from inference_lab.core.engine import Engine, RequestSpec
from inference_lab.core.roofline import Roofline
from tests.configs_util import (
    GPT_OSS_20B,
    PROFILES,
    config_error,
    dense_config,
    gpu_profile,
    merge,
    write_setup,
)


def ints(values: list[int]) -> np.ndarray[Any, np.dtype[np.int64]]:
    return np.array(values, dtype=np.int64)


def deploy(
    tmp_path: Path,
    config: dict[str, Any],
    profiles: dict[str, Any] | None = None,
    hardware: str = "gpu",
) -> Deployment:
    sub = tmp_path / f"case{len(list(tmp_path.iterdir()))}"
    sub.mkdir()
    path, profiles_dir = write_setup(sub, config, profiles)
    return load_model_config(path, profiles_dir).deployments[hardware]


# ---------------------------------------------------------------------------------------
# defaults: nothing moves


@pytest.mark.parametrize(
    ("n", "c"),
    [([1] * 8, [100] * 8), ([100] * 8, [0] * 8), ([300] * 24, [0] * 24), ([1] * 256, [100] * 256)],
)
def test_explicit_default_efficiency_prices_bit_for_bit_as_the_roofline(
    tmp_path: Path, n: list[int], c: list[int]
) -> None:
    """gpt-oss-20b on b200 with ``[efficiency]`` written out at its defaults (1.0, 1.0,
    0 s) prices the reference batches to the last bit as the shipped profile does."""
    shipped = Roofline(load_deployment(GPT_OSS_20B, "b200", PROFILES))
    profiles = tmp_path / "profiles"
    profiles.mkdir()
    for shipped_profile in PROFILES.glob("*.toml"):
        (profiles / shipped_profile.name).write_text(shipped_profile.read_text())
    text = (PROFILES / "b200.toml").read_text()
    text += "\n[efficiency]\nmemory_bandwidth = 1.0\nflops = 1.0\nstep_overhead = 0.0\n"
    (profiles / "b200.toml").write_text(text)
    explicit = Roofline(load_deployment(GPT_OSS_20B, "b200", profiles))
    a, b = shipped.step_cost(ints(n), ints(c)), explicit.step_cost(ints(n), ints(c))
    assert a == b
    terms = explicit.batch_terms(n, c)
    assert explicit.price(terms) == shipped.price(shipped.batch_terms(n, c))


def test_shipped_profiles_have_the_identity_efficiency() -> None:
    """No shipped datasheet profile sets an efficiency: their prices are the roofline's."""
    dep = load_deployment(GPT_OSS_20B, "b200", PROFILES)
    assert dep.efficiency.is_identity
    assert dep.profile.base is None


# ---------------------------------------------------------------------------------------
# closed forms


def test_bandwidth_efficiency_divides_memory_time_and_overhead_adds(tmp_path: Path) -> None:
    """A memory-bound decode of the 1e9-parameter bf16 model on 1 TB/s: bytes / (BW · 0.8)
    + 50 µs; alpha and beta apply after (alpha · (t + overhead) + beta)."""
    eff = {"memory_bandwidth": 0.8, "flops": 0.5, "step_overhead": 5e-5}
    dep = deploy(tmp_path, dense_config(), {"gpu": gpu_profile(efficiency=eff)})
    rf = Roofline(dep)
    # 8 decodes at c = 99 (m = 100): weights 2e9 B + KV 4 layers · 512 B · 100 · 8
    data = 2e9 + 4 * 512 * 100 * 8
    expected = data / (1e12 * 0.8) + 5e-5
    cost = rf.step_cost(ints([1] * 8), ints([99] * 8))
    assert cost.seconds == pytest.approx(expected, rel=1e-12)
    assert cost.roofline == cost.seconds
    # memory time at datasheet peak: the share of peak bandwidth reached is below 0.8
    assert cost.memory == pytest.approx(data / 1e12, rel=1e-12)
    assert cost.memory / cost.roofline < 0.8
    tc = {"hardware": {"gpu": {"time_correction": {"alpha": 1.5, "beta": 0.002}}}}
    corrected = Roofline(
        deploy(tmp_path, merge(dense_config(), tc), {"gpu": gpu_profile(efficiency=eff)})
    )
    assert corrected.step_cost(ints([1] * 8), ints([99] * 8)).seconds == pytest.approx(
        1.5 * expected + 0.002, rel=1e-12
    )


def test_flops_efficiency_divides_compute_time(tmp_path: Path) -> None:
    """A compute-bound prefill (4,000 tokens from scratch, 1 PFLOP/s bf16 at 0.5): FLOPs /
    (R · 0.5), with the attention FLOPs of the chunk's midpoint."""
    dep = deploy(tmp_path, dense_config(), {"gpu": gpu_profile(efficiency={"flops": 0.5})})
    rf = Roofline(dep)
    flops = 2 * 1e9 * 4000 + 4 * 4 * 8 * 64 * 4000 * 2000
    cost = rf.step_cost(ints([4000]), ints([0]))
    assert cost.seconds == pytest.approx(flops / (1e15 * 0.5), rel=1e-12)
    assert cost.compute == pytest.approx(flops / 1e15, rel=1e-12)


def test_entry_efficiency_overrides_the_profiles_key_by_key(tmp_path: Path) -> None:
    """An entry's ``efficiency`` table replaces only the keys it sets."""
    config = dense_config(hardware={"gpu": {"efficiency": {"step_overhead": 1e-4}}})
    profile = gpu_profile(efficiency={"memory_bandwidth": 0.5, "step_overhead": 2e-5})
    dep = deploy(tmp_path, config, {"gpu": profile})
    assert (dep.efficiency.memory_bandwidth, dep.efficiency.flops) == (0.5, 1.0)
    assert dep.efficiency.step_overhead == 1e-4


def test_engine_steps_cost_the_overhead(tmp_path: Path) -> None:
    """The engine's steps (priced through ``batch_terms`` / ``price``) carry the overhead:
    one request's prefill and decodes each last their roofline + 1 ms."""
    plain = deploy(tmp_path, dense_config())
    slow = deploy(tmp_path, dense_config(hardware={"gpu": {"efficiency": {"step_overhead": 1e-3}}}))
    durations = []
    for dep in (plain, slow):
        engine = Engine(dep)
        engine.submit(RequestSpec(prompt_tokens=100, max_tokens=4))
        steps = []
        while engine.next_event_time() is not None:
            ev = engine.step()
            if ev.step is not None:
                steps.append(ev.step.duration)
        durations.append(steps)
    assert len(durations[0]) == len(durations[1]) == 4
    for a, b in zip(*durations, strict=True):
        assert b == pytest.approx(a + 1e-3, rel=1e-12)


# ---------------------------------------------------------------------------------------
# layered profiles and entries naming their profile


def test_a_profile_with_a_base_inherits_the_datasheet_and_adds_efficiency(tmp_path: Path) -> None:
    """``gpu-cal.toml`` = ``base = "gpu"`` + ``[efficiency]``: the datasheet numbers come
    from ``gpu.toml``; an entry ``[hardware.cal] profile = "gpu-cal"`` uses it, beside the
    datasheet entry, which is unchanged."""
    calibrated = {"base": "gpu", "name": "Test GPU (calibrated)", "efficiency": {"flops": 0.7}}
    config = dense_config(hardware={"gpu": {}, "cal": {"profile": "gpu-cal", "tp": 2}})
    sub = tmp_path / "x"
    sub.mkdir()
    path, profiles_dir = write_setup(sub, config, {"gpu": gpu_profile(), "gpu-cal": calibrated})
    deps = load_model_config(path, profiles_dir).deployments
    cal, plain = deps["cal"], deps["gpu"]
    assert cal.profile.name == "Test GPU (calibrated)"
    assert cal.profile.base == "gpu"
    assert cal.profile.memory_bandwidth == plain.profile.memory_bandwidth
    assert cal.profile.fabric == plain.profile.fabric
    assert cal.efficiency.flops == 0.7 and plain.efficiency.is_identity
    assert cal.hardware.tp == 2


@pytest.mark.parametrize(
    ("profiles", "entry", "expected"),
    [
        (
            {"gpu": gpu_profile(), "cal": {"base": "nope"}},
            {"profile": "cal"},
            "cal.toml: base: no hardware profile",
        ),
        (
            {"gpu": gpu_profile(base="other"), "other": gpu_profile(), "cal": {"base": "gpu"}},
            {"profile": "cal"},
            "has a base itself",
        ),
        (
            {"gpu": gpu_profile()},
            {"profile": "missing"},
            "hardware.gpu.profile: no hardware profile",
        ),
        ({"gpu": gpu_profile()}, {"profile": ""}, "hardware.gpu.profile: must be a non-empty name"),
        (
            {"gpu": gpu_profile(efficiency={"memory_bandwidth": 1.5})},
            {},
            "efficiency.memory_bandwidth: must be <= 1",
        ),
        (
            {"gpu": gpu_profile()},
            {"efficiency": {"flops": 0}},
            "hardware.gpu.efficiency.flops: must be > 0",
        ),
        (
            {"gpu": gpu_profile()},
            {"efficiency": {"step_overhed": 1e-5}},
            "hardware.gpu.efficiency.step_overhed: unknown key (did you mean step_overhead?)",
        ),
    ],
)
def test_bad_profiles_and_entries_are_one_line(
    tmp_path: Path, profiles: dict[str, Any], entry: dict[str, Any], expected: str
) -> None:
    """Every mistake in a layered profile, an entry's profile name or an efficiency is one
    line naming the file and key."""
    path, profiles_dir = write_setup(tmp_path, dense_config(hardware={"gpu": entry}), profiles)
    message = config_error(load_model_config, path, profiles_dir)
    assert expected in message


def _one_request() -> Any:
    """A workload of one request of 10 + 10 tokens (what ``sim``'s configuration block
    is printed for here)."""
    from inference_lab.core.config import FixedDist, Workload

    return Workload(
        arrival_pattern="batched",
        num_requests=1,
        input_len_dist=FixedDist(value=10),
        output_len_dist=FixedDist(value=10),
        seed=0,
    )


def test_sim_prints_and_records_the_efficiency(tmp_path: Path) -> None:
    """``sim``'s configuration block names a non-default efficiency and a step table, and
    its JSON records both; a datasheet deployment prints neither line."""
    from inference_lab.sim.text import config_dict, format_config

    workload = _one_request()
    eff = {"memory_bandwidth": 0.8, "flops": 0.5, "step_overhead": 5e-5}
    dep = deploy(tmp_path, dense_config(), {"gpu": gpu_profile(efficiency=eff)})
    text = format_config(dep, workload, "w.toml", 0)
    assert "efficiency HBM bandwidth 0.8, FLOP/s 0.5 of the datasheet; 0.05 ms per step" in text
    assert config_dict(dep, workload, "w.toml", 0)["efficiency"] == eff
    plain = deploy(tmp_path, dense_config())
    assert "efficiency" not in format_config(plain, workload, "w.toml", 0)
    assert "step table" not in format_config(plain, workload, "w.toml", 0)


def test_sim_prints_and_records_a_routing_skew(tmp_path: Path) -> None:
    """A set ``expert_skew`` is named in ``sim``'s configuration block and recorded in its
    JSON; at its default the JSON has no such key (what it recorded before the term)."""
    from inference_lab.sim.text import config_dict, format_config

    workload = _one_request()
    eff = {"memory_bandwidth": 0.8, "expert_skew": 1.5}
    dep = deploy(tmp_path, dense_config(), {"gpu": gpu_profile(efficiency=eff)})
    text = format_config(dep, workload, "w.toml", 0)
    assert "0 ms per step; MoE routing skew 1.5" in text
    assert config_dict(dep, workload, "w.toml", 0)["efficiency"]["expert_skew"] == 1.5
    plain = deploy(tmp_path, dense_config(), {"gpu": gpu_profile(efficiency={"flops": 0.5})})
    assert "expert_skew" not in config_dict(plain, workload, "w.toml", 0)["efficiency"]
    assert "skew" not in format_config(plain, workload, "w.toml", 0)


def test_sim_prints_and_records_a_layer_overhead(tmp_path: Path) -> None:
    """A set ``layer_overhead`` is named in ``sim``'s configuration block and recorded in
    its JSON; at its default the JSON has no such key (what it recorded before the term)."""
    from inference_lab.sim.text import config_dict, format_config

    workload = _one_request()
    eff = {"memory_bandwidth": 0.8, "layer_overhead": 4e-5}
    dep = deploy(tmp_path, dense_config(), {"gpu": gpu_profile(efficiency=eff)})
    text = format_config(dep, workload, "w.toml", 0)
    assert "0 ms per step; 40 µs per layer per step" in text
    assert config_dict(dep, workload, "w.toml", 0)["efficiency"]["layer_overhead"] == 4e-5
    plain = deploy(tmp_path, dense_config(), {"gpu": gpu_profile(efficiency={"flops": 0.5})})
    assert "layer_overhead" not in config_dict(plain, workload, "w.toml", 0)["efficiency"]
    assert "per layer" not in format_config(plain, workload, "w.toml", 0)
