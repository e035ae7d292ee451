"""LoRA adapters' configuration (``[lora]``): the GPU slots, the largest rank, the host
cache, the adapters served from the start.

Rule 1: a class is valid at construction or raises a FieldError naming the field: vLLM's
        own checks (``max_lora_rank`` one of its ranks, ``max_cpu_loras >= max_loras``),
        adapter names unique, no adapter's rank above ``max_lora_rank``.
Rule 2: the adapters' sizes follow from their rank and the model's shapes
        (:func:`adapter_widths`): a LoRA pair on a projection ``in -> out`` holds
        ``rank * (in + out)`` values. Nothing here reads a file: an adapter's ``path`` is
        only a name, as a served adapter's weights are never loaded.
"""

from __future__ import annotations

import attrs

from inference_lab.core.config.checks import ge
from inference_lab.core.config.model import AttentionLayer, MLALayer, ModelArch
from inference_lab.validation import FieldError

__all__ = ["LORA_RANKS", "LoraAdapter", "LoraConfig", "adapter_widths"]

#: The ranks vLLM accepts for ``--max-lora-rank`` (its ``MaxLoRARanks``).
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def _name(_inst: object, attr: attrs.Attribute[str], value: str) -> None:
    if not value or value != value.strip():
        raise FieldError(attr.name, f"must be a non-empty name, got {value!r}")


@attrs.frozen(kw_only=True)
class LoraAdapter:
    """One adapter: its ``name`` (what a request's ``model`` names), its ``path`` (a name
    here; empty: the name), its ``rank`` (0: ``max_lora_rank``) and the base model it
    adapts (``base_model_name``, vLLM's JSON form of ``--lora-modules``; None: the
    served model)."""

    name: str = attrs.field(validator=_name)
    path: str = ""
    rank: int = attrs.field(default=0, validator=ge(0))
    base_model_name: str | None = None


@attrs.frozen(kw_only=True)
class LoraConfig:
    """``[lora]``, as vLLM's ``--enable-lora`` flags: ``max_loras`` adapters in one batch
    (and GPU slots per replica), ``max_lora_rank`` (the slots' rank: every adapter is
    padded to it in the kernels), ``max_cpu_loras`` adapters kept in host memory (0:
    ``max_loras``), ``mlp_dim`` the MLP's intermediate size when the adapters also adapt
    the MLP's gate, up and down projections (0: attention projections only), and the
    adapters served from the start."""

    max_loras: int = attrs.field(default=1, validator=ge(1))
    max_lora_rank: int = attrs.field(default=16)
    max_cpu_loras: int = attrs.field(default=0, validator=ge(0))
    mlp_dim: int = attrs.field(default=0, validator=ge(0))
    adapters: tuple[LoraAdapter, ...] = ()

    def __attrs_post_init__(self) -> None:
        if self.max_lora_rank not in LORA_RANKS:
            raise FieldError(
                "max_lora_rank",
                f"must be one of {', '.join(map(str, LORA_RANKS))}, got {self.max_lora_rank}",
            )
        if self.max_cpu_loras and self.max_cpu_loras < self.max_loras:
            raise FieldError(
                "max_cpu_loras",
                f"must be >= max_loras ({self.max_loras}), got {self.max_cpu_loras}",
            )
        seen: set[str] = set()
        for i, a in enumerate(self.adapters):
            if a.name in seen:
                raise FieldError(f"adapters.{i}.name", f"{a.name!r} is named twice")
            seen.add(a.name)
            if a.rank > self.max_lora_rank:
                raise FieldError(
                    f"adapters.{i}.rank",
                    f"must be <= max_lora_rank ({self.max_lora_rank}), got {a.rank}",
                )

    @property
    def cpu_slots(self) -> int:
        """Adapters kept in host memory (vLLM: ``max_cpu_loras``, default ``max_loras``)."""
        return self.max_cpu_loras or self.max_loras

    def rank_of(self, adapter: LoraAdapter) -> int:
        """The adapter's rank (its own, else ``max_lora_rank``)."""
        return adapter.rank or self.max_lora_rank


def adapter_widths(model: ModelArch, mlp_dim: int) -> int:
    """``sum(in + out)`` over the projections one adapter adapts, over every layer: per
    attention layer ``q`` (hidden -> heads x head_dim), ``k`` and ``v`` (hidden -> kv_heads
    x head_dim) and ``o`` (heads x head_dim -> hidden); per MLA layer its query (hidden ->
    heads x (nope + rope)) and output (heads x v_head_dim -> hidden) projections; with
    ``mlp_dim`` I, per layer ``gate`` and ``up`` (hidden -> I) and ``down`` (I -> hidden).
    A rank-r adapter holds ``r x adapter_widths`` values (Rule 2)."""
    hidden = model.hidden_dim
    total = 0
    layers = 0
    for layer in model.layers:
        layers += layer.count
        if isinstance(layer, AttentionLayer):
            q = layer.heads * layer.head_dim
            kv = layer.kv_heads * layer.head_dim
            total += layer.count * (4 * hidden + 2 * q + 2 * kv)
        elif isinstance(layer, MLALayer):
            q = layer.heads * (layer.qk_nope_dim + layer.rope_dim)
            o = layer.heads * layer.v_head_dim
            total += layer.count * (2 * hidden + q + o)
    if mlp_dim:
        total += layers * 3 * (hidden + mlp_dim)
    return total
