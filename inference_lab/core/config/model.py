"""A model's architecture: weight streams, layers, reasoning (``[model]``).

Rule 1: a class is valid at construction or raises a FieldError naming the field
        (``@attrs.frozen``; the checks of :mod:`~inference_lab.core.config.checks`).
Rule 2: byte counts are derived here from the datasheet values and
        :data:`BYTES_PER_VALUE` only (a stream's resident bytes are floored once), so the
        roofline and the KV accounting read one definition.
Rule 3: a model has at least one full-context attention class (``window = 0``): it
        defines the KV block size.
"""

from __future__ import annotations

import math
from typing import Any

import attrs

from inference_lab.core.config.checks import ge, gt, le, nonempty, one_of, optional_nonempty
from inference_lab.validation import FieldError

__all__ = [
    "BYTES_PER_VALUE",
    "EFFORTS",
    "KV_LAYERS",
    "PRECISIONS",
    "AttentionLayer",
    "Layer",
    "LinearLayer",
    "MLALayer",
    "ModelArch",
    "ReasoningConfig",
    "Routing",
    "WeightStream",
]

BYTES_PER_VALUE: dict[str, float] = {"fp4": 0.5, "fp8": 1.0, "bf16": 2.0, "fp16": 2.0, "fp32": 4.0}
PRECISIONS = tuple(BYTES_PER_VALUE)


@attrs.frozen(kw_only=True)
class Routing:
    routed_experts: int = attrs.field(validator=ge(1))
    experts_per_tok: int = attrs.field(validator=ge(1))
    moe_layers: int = attrs.field(validator=ge(1))
    #: One expert's intermediate width (0: not given). With the model's ``hidden_dim`` it
    #: is the shape an engine pads when it lays the experts out for its kernels
    #: (``[overheads] expert_hidden_multiple`` / ``expert_intermediate_multiple``).
    expert_intermediate_dim: int = attrs.field(default=0, validator=ge(0))


@attrs.frozen(kw_only=True)
class WeightStream:
    precision: str = attrs.field(validator=one_of(PRECISIONS))
    active_params: float = attrs.field(validator=gt(0))
    resident_params: float = attrs.field()
    routing: Routing | None = None
    #: Values that share one 1-byte block scale in the checkpoint's format (MXFP4: 32;
    #: 0: none given). Counted in the KV accounting only where a profile's
    #: ``[overheads] weight_scales`` says the engine holds them (docs/fidelity.md).
    scale_block: int = attrs.field(default=0, validator=ge(0))

    @resident_params.validator
    def _check_resident(self, attr: attrs.Attribute[Any], value: float) -> None:
        if value < self.active_params:
            raise FieldError(
                attr.name, f"must be >= active_params ({self.active_params:g}), got {value:g}"
            )

    @property
    def resident_bytes(self) -> int:
        return math.floor(self.resident_params * BYTES_PER_VALUE[self.precision])

    @property
    def expert_params(self) -> float:
        """The routed experts' parameters, ``E * per_expert`` with ``per_expert = (resident
        - active) / (E - k)`` (0 without routing, or when every expert is active): what
        expert parallelism shards; the rest is the stream's dense part."""
        r = self.routing
        if r is None or r.routed_experts <= r.experts_per_tok:
            return 0.0
        per_expert = (self.resident_params - self.active_params) / (
            r.routed_experts - r.experts_per_tok
        )
        return r.routed_experts * per_expert


@attrs.frozen(kw_only=True)
class AttentionLayer:
    kind: str = attrs.field(default="attention")
    count: int = attrs.field(validator=ge(1))
    heads: int = attrs.field(validator=ge(1))
    head_dim: int = attrs.field(validator=ge(1))
    kv_heads: int = attrs.field(validator=ge(1))
    kv_precision: str = attrs.field(default="bf16", validator=one_of(PRECISIONS))
    kv_shared: bool = False
    window: int = attrs.field(default=0, validator=ge(0))

    @property
    def kv_bytes_per_position(self) -> float:
        return (
            (1 if self.kv_shared else 2)
            * self.kv_heads
            * self.head_dim
            * BYTES_PER_VALUE[self.kv_precision]
        )


@attrs.frozen(kw_only=True)
class MLALayer:
    """Multi-head latent attention (DeepSeek-V2/V3): the KV cache holds one latent vector
    of ``kv_latent_dim`` plus a shared rope key of ``rope_dim`` per position, whatever the
    head count. Decode steps compute in the absorbed form (multi-query attention over the
    latent), prefill chunks in the expanded form (the latent up-projected to ``heads``
    keys and values); ``docs/internals.md`` gives the FLOPs of both. ``q_latent_dim`` is
    the query's low-rank dimension (``q_lora_rank``, 0: none): recorded, it enters no
    cost (the projections are parameters of the weight streams)."""

    kind: str = attrs.field(default="mla")
    count: int = attrs.field(validator=ge(1))
    heads: int = attrs.field(validator=ge(1))
    kv_latent_dim: int = attrs.field(validator=ge(1))
    rope_dim: int = attrs.field(default=0, validator=ge(0))
    qk_nope_dim: int = attrs.field(validator=ge(1))
    v_head_dim: int = attrs.field(validator=ge(1))
    q_latent_dim: int = attrs.field(default=0, validator=ge(0))
    kv_precision: str = attrs.field(default="bf16", validator=one_of(PRECISIONS))
    window: int = attrs.field(default=0, validator=ge(0))

    @property
    def kv_bytes_per_position(self) -> float:
        """Bytes one GPU holding this layer's cache keeps per position: the latent and the
        rope key (replicated on every GPU of an attention group: ``Deployment``)."""
        return (self.kv_latent_dim + self.rope_dim) * BYTES_PER_VALUE[self.kv_precision]


@attrs.frozen(kw_only=True)
class LinearLayer:
    kind: str = attrs.field(default="linear")
    count: int = attrs.field(validator=ge(1))
    state_bytes: int = attrs.field(validator=ge(0))


Layer = AttentionLayer | MLALayer | LinearLayer
#: The layer kinds that keep a KV cache per position.
KV_LAYERS = (AttentionLayer, MLALayer)

#: Reasoning efforts a request may ask for (``none``: no reasoning tokens).
EFFORTS = ("none", "minimal", "low", "medium", "high")


@attrs.frozen(kw_only=True)
class ReasoningConfig:
    """``[model.reasoning]``: the model reasons (gpt-oss, Qwen3 thinking). Each ratio is
    the share of a chat / Responses answer's output tokens spent reasoning at that
    effort; ``default_effort`` applies when a request names none. Used by the serve
    API only (``docs/agents.md``); the engine counts every output token alike."""

    default_effort: str = attrs.field(default="medium", validator=one_of(EFFORTS))
    minimal: float = attrs.field(default=0.1, validator=[ge(0), le(0.95)])
    low: float = attrs.field(default=0.2, validator=[ge(0), le(0.95)])
    medium: float = attrs.field(default=0.5, validator=[ge(0), le(0.95)])
    high: float = attrs.field(default=0.8, validator=[ge(0), le(0.95)])

    def ratio(self, effort: str) -> float:
        """The share of output tokens spent reasoning at ``effort`` (0 for ``none``)."""
        return 0.0 if effort == "none" else float(getattr(self, effort))


@attrs.frozen(kw_only=True)
class ModelArch:
    name: str = attrs.field(validator=attrs.validators.min_len(1))
    hidden_dim: int = attrs.field(validator=ge(1))
    max_seq_len: int = attrs.field(validator=ge(2))
    attention_precision: str = attrs.field(default="bf16", validator=one_of(PRECISIONS))
    activation_bytes: int = attrs.field(default=2, validator=ge(1))
    weights: tuple[WeightStream, ...] = attrs.field(validator=nonempty)
    layers: tuple[Layer, ...] = attrs.field(validator=nonempty)
    #: A tokenizer file (``tokenizer.json``, a ``.tiktoken`` rank file, or a directory
    #: holding ``tokenizer.json``) written relative to the config file; after loading,
    #: the resolved path. None: prompts are counted by the byte rule.
    tokenizer: str | None = attrs.field(default=None, validator=optional_nonempty)
    #: ``[model.reasoning]``: part of each chat answer is reasoning (None: none is).
    reasoning: ReasoningConfig | None = None
    #: The tokenizer's vocabulary (the LM head's rows; 0: not given). Read only by the
    #: profile-run term of the KV accounting (``[overheads] profile_run``).
    vocab_size: int = attrs.field(default=0, validator=ge(0))

    @layers.validator
    def _check_full_attention(self, attr: attrs.Attribute[Any], value: tuple[Layer, ...]) -> None:
        if not any(isinstance(layer, KV_LAYERS) and layer.window == 0 for layer in value):
            raise FieldError(
                attr.name,
                "needs at least one full-context attention class (window = 0); "
                "the KV block size is defined by those layers",
            )

    @property
    def num_layers(self) -> int:
        return sum(layer.count for layer in self.layers)

    @property
    def resident_weight_bytes(self) -> int:
        return sum(w.resident_bytes for w in self.weights)

    @property
    def moe_layers(self) -> int:
        """The MoE layers of the routed streams (the largest ``moe_layers``; 0 without
        routing): where expert parallelism exchanges tokens."""
        return max((w.routing.moe_layers for w in self.weights if w.routing is not None), default=0)
