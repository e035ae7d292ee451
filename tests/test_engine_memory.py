"""The KV capacity as vLLM sizes it (``[overheads] weight_scales``, ``expert_*_multiple``,
``profile_run``; docs/fidelity.md#the-kv-capacity-as-vllm-computes-it): each term against
a hand computation, the defaults against the plain accounting, and a bad config."""

from __future__ import annotations

import math
from pathlib import Path

import attrs
import pytest

from inference_lab.core.config import engine_memory
from inference_lab.core.config.deployment import Deployment
from inference_lab.core.config.hardware import Overheads
from inference_lab.core.config.loading import load_model_config
from inference_lab.errors import ConfigError

ROOT = Path(__file__).resolve().parent.parent
GIB = 2**30


def _dep(config: str, entry: str) -> Deployment:
    return load_model_config(ROOT / config).deployments[entry]


def _with(dep: Deployment, **keys: object) -> Deployment:
    return attrs.evolve(dep, hardware=attrs.evolve(dep.hardware, overheads=Overheads(**keys)))  # type: ignore[arg-type]


def test_mxfp4_experts_as_the_marlin_kernel_holds_them() -> None:
    """gpt-oss-120b's 128 x 36 experts of 3 x 2880 x 2880 MXFP4 values, padded to 3 x 3072
    x 2944 (hidden to 256, intermediate to 128) and held at half a byte plus one scale byte
    per 32 values (4,608 x 3 x 3,072 x 2,944 values, computed below). The total
    with the bf16 stream (65.82 GiB) is within 0.2 % of the 65.97 GiB vLLM logs for this
    model on one H100 with the Marlin backend (vllm-project/vllm issue 23278)."""
    dep = _dep("configs/gpt-oss-120b.toml", "h100")
    over = Overheads(
        weight_scales=True, expert_hidden_multiple=256, expert_intermediate_multiple=128
    )
    padded = 128 * 36 * 3 * 3072 * 2944
    fp4_held = padded // 2 + padded // 32
    expected = fp4_held - 114_661_785_600 // 2
    weights = list(dep.model.weights)
    assert engine_memory.loaded_extra_bytes(weights, 2880, over) == expected
    loaded = dep.resident_weight_bytes + expected
    assert loaded / GIB == pytest.approx(65.82, abs=0.01)
    # scales alone (a kernel that pads nothing, 2880 being a multiple of 64): 1/32 byte each
    scales = Overheads(weight_scales=True, expert_intermediate_multiple=64)
    assert engine_memory.loaded_extra_bytes(weights, 2880, scales) == 114_661_785_600 // 32


def test_padding_is_per_gpu_share_of_the_intermediate_width() -> None:
    """At tp 2 each GPU holds 1,440 of gpt-oss's 2,880 intermediate columns, padded to
    1,536 (a multiple of 128): the experts grow by 3,072 / 2,880 (no scales, no hidden pad)."""
    dep = _dep("configs/gpt-oss-120b.toml", "h100")
    over = Overheads(expert_intermediate_multiple=128)
    fp4 = dep.model.weights[0]
    extra = engine_memory.loaded_extra_bytes([fp4], 2880, over, tp=2)
    assert extra == math.floor(114_661_785_600 * 3072 / 2880 * 0.5) - 114_661_785_600 // 2


def test_the_profile_runs_peak() -> None:
    """8,192 tokens of Qwen3-32B (hidden 5,120, bf16) kept, and 1,024 rows of 151,936
    logits at 2 + 4 + 4 + 4 bytes: 83,886,080 + 2,178,154,496 = 2,262,040,576 bytes."""
    dep = _dep("configs/fidelity/Qwen3-32B.toml", "h100-vllm")
    assert (dep.scheduler.max_num_batched_tokens, dep.scheduler.max_num_seqs) == (8192, 1024)
    assert engine_memory.profile_run_bytes(dep.model, dep.scheduler) == 2_262_040_576
    # fewer sequences than tokens allowed: the rows are the sequences
    few = attrs.evolve(dep.scheduler, max_num_seqs=16)
    assert engine_memory.profile_run_bytes(dep.model, few) == 8192 * 5120 * 2 + 16 * 151936 * 14


def test_the_kv_cache_is_the_pool_less_the_loaded_weights_and_the_peak() -> None:
    """gpt-oss-120b on h100-vllm: floor(85,520,809,984 x 0.9) less the weights as loaded
    less one profile run's peak; with every key off the accounting is the plain one."""
    dep = _dep("configs/gpt-oss-120b.toml", "h100-vllm")
    pool = math.floor(85_520_809_984 * 0.9)
    padded = 128 * 36 * 3 * 3072 * 2944
    loaded = padded // 2 + padded // 32 + 2_127_052_800 * 2
    peak = 8192 * 2880 * 2 + 1024 * 201088 * 14
    assert dep.kv_bytes == pool - loaded - peak
    plain = _with(dep)
    assert plain.kv_bytes == pool - dep.resident_weight_bytes
    assert not engine_memory.active(plain.overheads)
    # at tp 2 the peak is held on each GPU
    two = attrs.evolve(dep, hardware=attrs.evolve(dep.hardware, tp=2))
    scales_pad = engine_memory.loaded_extra_bytes(list(dep.model.weights), 2880, dep.overheads, 2)
    assert two.kv_bytes == math.floor(85_520_809_984 * 2 * 0.9) - (
        dep.resident_weight_bytes + scales_pad + 2 * peak
    )


def test_profile_run_without_a_vocabulary_is_a_one_line_error(tmp_path: Path) -> None:
    """A model without ``vocab_size`` on a profile with ``profile_run``: the loader names
    the entry and the key."""
    text = (ROOT / "configs/Llama-3.1-8B-Instruct.toml").read_text()
    text = text.replace("vocab_size = 128256\n", "")
    text = text[: text.index("\n# Calibrated on vLLM")]  # its own vLLM entries need the vocabulary
    assert "vocab_size" not in text
    path = tmp_path / "m.toml"
    path.write_text(
        text + '\n[hardware.probe]\nprofile = "h100"\noverheads = { profile_run = true }\n'
    )
    with pytest.raises(ConfigError, match=r"hardware\.probe: \[overheads\] profile_run needs"):
        load_model_config(path, ROOT / "hardware_profiles")


def test_the_vllm_profiles_compute_the_memory_instead_of_fitting_it() -> None:
    """``h100-vllm`` and ``h200-vllm`` set the four keys (Marlin's multiples) and keep no
    fitted ``reserved_memory``; the datasheet profiles set none of them."""
    from inference_lab.core.config.loading import load_hardware_profile

    for name in ("h100-vllm", "h200-vllm"):
        over = load_hardware_profile(ROOT / "hardware_profiles" / f"{name}.toml").overheads
        assert over.weight_scales and over.profile_run
        assert (over.expert_hidden_multiple, over.expert_intermediate_multiple) == (256, 128)
        assert over.reserved_memory == 0
    for name in ("h100", "h200"):
        over = load_hardware_profile(ROOT / "hardware_profiles" / f"{name}.toml").overheads
        assert over == Overheads()
