"""The memory an engine keeps out of its KV cache, as vLLM sizes it (docs/fidelity.md).

Rule 1: pure arithmetic on a model's shapes, its scheduler's limits and a profile's
        ``[overheads]`` keys; with every key at its default the bytes held back are 0
        and the KV accounting does not call in here (datasheet figures stay bit for bit).
Rule 2: everything is per replica (``tp`` GPUs): weights as the engine lays them out in
        memory, and the profile run's activation peak once per GPU.

vLLM sizes its KV cache as the requested share of the GPU less the weights as loaded,
less the peak of a profiling forward pass, less what memory outside torch grew by during
it (vllm/v1/worker/gpu_worker.py, ``determine_available_memory``).
"""

from __future__ import annotations

import math

from inference_lab.core.config.hardware import Overheads
from inference_lab.core.config.model import BYTES_PER_VALUE, ModelArch, WeightStream
from inference_lab.core.config.scheduler import SchedulerConfig
from inference_lab.errors import ConfigError

__all__ = [
    "SAMPLER_BYTES_PER_LOGIT",
    "active",
    "held_back_bytes",
    "loaded_extra_bytes",
    "profile_run_bytes",
]

#: Bytes per logit the profile run's sampler holds at once: the LM head's bf16 output,
#: the sampler's float32 copy, the float32 probabilities of random sampling and the
#: float32 exponential noise it divides them by (vllm/v1/sample/sampler.py and
#: ops/topk_topp_sampler.py: the dummy run samples at temperature 0.5, so randomly).
SAMPLER_BYTES_PER_LOGIT = 2 + 4 + 4 + 4


def active(over: Overheads) -> bool:
    """Whether any key of the vLLM memory model is on."""
    return (
        over.weight_scales
        or over.profile_run
        or over.expert_hidden_multiple > 1
        or over.expert_intermediate_multiple > 1
    )


def _padded_params(w: WeightStream, hidden_dim: int, over: Overheads, tp: int) -> float:
    """The stream's parameters with its routed experts' widths rounded up to the
    profile's multiples (an expert's matrices are hidden x intermediate, the
    intermediate split over ``tp`` GPUs and each GPU's share padded; the kernels take
    them padded, so the padding is held)."""
    r = w.routing
    if r is None or r.expert_intermediate_dim == 0:
        return w.resident_params
    h, i = hidden_dim, r.expert_intermediate_dim
    hp = math.ceil(h / over.expert_hidden_multiple) * over.expert_hidden_multiple
    im = over.expert_intermediate_multiple
    ip = math.ceil(i / tp / im) * im * tp
    if (hp, ip) == (h, i):
        return w.resident_params
    experts = w.expert_params
    return w.resident_params - experts + experts * (hp * ip) / (h * i)


def loaded_extra_bytes(
    weights: list[WeightStream], hidden_dim: int, over: Overheads, tp: int = 1
) -> int:
    """Bytes one replica's weights take in memory beyond their resident bytes: the
    experts' padding, and (``weight_scales``) one byte per ``scale_block`` values of
    each stream that gives one. As vLLM's MXFP4 method creates them
    (vllm/model_executor/layers/quantization/mxfp4.py, ``create_weights``)."""
    extra = 0
    for w in weights:
        params = _padded_params(w, hidden_dim, over, tp)
        extra += math.floor(params * BYTES_PER_VALUE[w.precision]) - w.resident_bytes
        if over.weight_scales and w.scale_block:
            extra += math.floor(params / w.scale_block)
    return extra


def profile_run_bytes(model: ModelArch, scheduler: SchedulerConfig) -> int:
    """The profile run's activation peak on one GPU: vLLM runs one forward pass of
    ``max_num_batched_tokens`` tokens split over ``min(max_num_seqs, tokens)``
    requests, keeps its hidden states, and samples the last token of each request
    (vllm/v1/worker/gpu_model_runner.py, ``profile_run``, ``_dummy_run``,
    ``_dummy_sampler_run``): the peak is the hidden states plus the sampler's logits,
    ``T * hidden * activation_bytes + R * vocab * 14``. Raises ConfigError when the
    model gives no ``vocab_size``."""
    if model.vocab_size == 0:
        raise ConfigError(f"model {model.name!r}: [overheads] profile_run needs [model] vocab_size")
    tokens = scheduler.max_num_batched_tokens
    rows = min(scheduler.max_num_seqs, tokens)
    hidden = tokens * model.hidden_dim * model.activation_bytes
    return hidden + rows * model.vocab_size * SAMPLER_BYTES_PER_LOGIT


def held_back_bytes(
    model: ModelArch,
    weights: list[WeightStream],
    scheduler: SchedulerConfig,
    over: Overheads,
    tp: int,
) -> int:
    """Bytes of one replica's pool that hold no KV cache beyond its resident weights
    (and ``reserved_memory``): the weights' layout and, with ``profile_run``, the
    profile run's peak on each of its ``tp`` GPUs. Called by ``Deployment.kv_bytes``."""
    extra = loaded_extra_bytes(weights, model.hidden_dim, over, tp)
    if over.profile_run:
        extra += tp * profile_run_bytes(model, scheduler)
    return extra
