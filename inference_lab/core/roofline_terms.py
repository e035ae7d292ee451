"""What a step's price depends on: the batch's integer terms, the model's layer classes
they are summed per, the fabric's collectives, and the KV blocks a sequence holds
(:class:`~inference_lab.core.roofline.Roofline` is built on these; its module header
states the pricing rules).

Rule 1: a batch's terms (:class:`BatchTerms`) are integer sums over its sequences, taken
        once per batch: with numpy over arrays for a large batch, in Python integers for a
        small one (at most :data:`SMALL_BATCH`); the integers are the same either way, and
        adding a sequence to a batch's terms gives exactly the terms of the batch with it.
Rule 2: the layers are reduced once per roofline to window classes (ascending windows,
        full attention first as 0), MLA classes in the same order, the recurrent state's
        bytes and the windowed KV bytes per position; a price touches the batch once per
        class, never once per layer.
Rule 3: KV blocks are a pure function of the deployment and a sequence's resident
        positions: content blocks plus private blocks (windowed KV and recurrent state),
        which stop growing past the widest window.
Rule 4: the fabric's collectives are priced from its latency and bandwidth: an all-reduce
        in-network or as a ring (two levels across nodes), an all-to-all over NVLink
        and the NIC at once, the slower path's time.
"""

from __future__ import annotations

import array
import functools
import math
from collections.abc import Sequence
from typing import Any

import attrs
import numpy as np

from inference_lab.core.builders import frozen_builder
from inference_lab.core.config import (
    AttentionLayer,
    Deployment,
    Layer,
    LinearLayer,
    MLALayer,
    WeightStream,
)

IntArray = np.ndarray[Any, np.dtype[np.int64]]

#: a window class: (window, attention FLOPs per (query, key) pair, KV bytes per position)
WindowClass = tuple[int, float, float]
#: an MLA class: (window, absorbed, expanded and context FLOP coefficients, KV bytes)
MLAClass = tuple[int, float, float, float, float]


@attrs.frozen
class StepCost:
    """The price of one step: ``seconds`` after time_correction; ``roofline``, the step's
    time before it (efficiency and overhead included; a step table's time); and
    ``compute`` and ``memory``, the FLOP and byte times at datasheet peaks, so that
    ``compute / roofline`` is the share of peak FLOP/s the step reached (utilisation)."""

    seconds: float
    roofline: float
    compute: float
    memory: float


#: :class:`StepCost` from its fields in order, as its ``__init__`` (:mod:`.builders`)
_step_cost = frozen_builder(StepCost)

#: Batches of at most this many sequences are priced in Python integers (``batch_terms``).
SMALL_BATCH = 32


@attrs.define(slots=True)
class BatchTerms:
    """What a step's price depends on: its token count, its sequence count and, per
    attention window class of the model (ascending windows, full attention first as 0),
    the sums over its sequences of ``n * att`` and of ``att`` (``att`` = the positions a
    sequence attends at its chunk's midpoint, capped by the window). Per MLA class
    (``mla``, in the same order), the same two sums and two more over its prefill chunks
    only (``n`` above the decode width): ``n * att`` and the context ``min(c, window)``
    they up-project. All integers, so adding a sequence (:meth:`Roofline.add_sequence`)
    gives exactly the terms of the batch with it."""

    tokens: int
    seqs: int
    sums: list[list[int]]
    mla: list[list[int]] = attrs.field(factory=list)


def mla_flop_coefficients(layer: MLALayer) -> tuple[float, float, float]:
    """FLOPs of one MLA layer class (``count`` layers): per (query, key) pair in the
    absorbed form (decode: multi-query attention over the latent, ``2 N (2 Lkv + R)``), per
    pair in the expanded form (prefill: ``2 N (P + R + V)``), and per cached context
    position a prefill chunk up-projects to keys and values (``2 Lkv N (P + V)``).
    DeepSeek-V2 (arXiv:2405.04434) and vLLM's ``v1/attention/backends/mla/common.py``."""
    n, lkv, r = layer.heads, layer.kv_latent_dim, layer.rope_dim
    p, v = layer.qk_nope_dim, layer.v_head_dim
    count = layer.count
    return (
        count * 2.0 * n * (2 * lkv + r),
        count * 2.0 * n * (p + r + v),
        count * 2.0 * lkv * n * (p + v),
    )


@attrs.frozen
class LayerClasses:
    """Rule 2: a model's layers as the roofline prices them: the window classes and MLA
    classes (ascending windows), the recurrent state's bytes per sequence, and the
    windowed KV bytes per position by window (windows > 0, ascending)."""

    windows: list[WindowClass]
    mla: list[MLAClass]
    state_bytes: float
    windowed_kv: list[tuple[int, float]]


def layer_classes(dep: Deployment, layers: Sequence[Layer]) -> LayerClasses:
    """Reduce ``layers`` to their classes (Rule 2), summing each class's coefficients in
    layer order. :class:`~inference_lab.core.roofline.Roofline` calls it once."""
    attn_flops: dict[int, float] = {}  # window -> Σ count·4·heads·head_dim
    kv_bytes: dict[int, float] = {}  # window -> Σ count·kvpp
    mla: dict[int, list[float]] = {}  # window -> [absorbed, expanded, context, kv bytes]
    state = 0.0
    for layer in layers:
        if isinstance(layer, AttentionLayer):
            attn_flops[layer.window] = attn_flops.get(layer.window, 0.0) + (
                layer.count * 4 * layer.heads * layer.head_dim
            )
            kv_bytes[layer.window] = kv_bytes.get(layer.window, 0.0) + (
                layer.count * layer.kv_bytes_per_position
            )
        elif isinstance(layer, MLALayer):
            coef = mla.setdefault(layer.window, [0.0, 0.0, 0.0, 0.0])
            for i, value in enumerate(mla_flop_coefficients(layer)):
                coef[i] += value
            coef[3] += layer.count * dep.kv_bytes_per_position(layer)
        elif isinstance(layer, LinearLayer):
            state += layer.count * layer.state_bytes
    windowed = dict(kv_bytes)
    for window, coef in mla.items():
        windowed[window] = windowed.get(window, 0.0) + coef[3]
    return LayerClasses(
        windows=[(w, attn_flops[w], kv_bytes[w]) for w in sorted(attn_flops)],
        mla=[
            (window, mla[window][0], mla[window][1], mla[window][2], mla[window][3])
            for window in sorted(mla)
        ],
        state_bytes=state,
        windowed_kv=[(w, windowed[w]) for w in sorted(windowed) if w > 0],
    )


@functools.lru_cache(maxsize=1 << 16)
def zipf_coverage(num_experts: int, k: int, tokens: int, skew: float) -> float:
    """Expected distinct experts touched when ``tokens`` tokens each pick ``k`` of
    ``num_experts`` whose popularity falls as a Zipf law of exponent ``skew`` (the
    roofline's Rule 8): expert ``i`` (from 1) is picked with ``p_i = i^-skew / sum_j
    j^-skew`` by each of the ``k * tokens`` picks, so it is touched with probability
    ``1 - (1 - p_i)^(k * tokens)``, and the expectation is the sum over the experts."""
    ranks = np.arange(1, num_experts + 1, dtype=np.float64) ** -skew
    p = ranks / ranks.sum()
    return float(np.sum(1.0 - (1.0 - p) ** (k * tokens)))


def all_to_all_time(dep: Deployment, tokens: int, k: int) -> float:
    """One all-to-all (an MoE layer's dispatch, or its combine) of ``tokens`` tokens over
    ``ep`` GPUs: each GPU sends its ``tokens / ep`` tokens' hidden vectors to the other GPUs
    holding one of their ``k`` experts (``ep - 1`` GPUs, each with probability ``q = 1 -
    (1 - 1/ep)^k``), over NVLink within a node and the NIC across nodes, both at once:
    ``latency + bytes / bandwidth`` of the slower path. 0 without tokens or with ep 1."""
    ep = dep.hardware.ep
    fabric = dep.profile.fabric
    if ep <= 1 or tokens == 0 or fabric is None:
        return 0.0
    model = dep.model
    q = 1.0 - (1.0 - 1.0 / ep) ** k
    per_peer = tokens / ep * q * model.hidden_dim * model.activation_bytes
    up = fabric.scale_up
    node = fabric.gpus_per_node
    if ep <= node:
        return up.latency + (ep - 1) * per_peer / up.bandwidth
    out = fabric.scale_out
    assert out is not None  # validation: ep <= tp and tp > gpus_per_node needs scale_out
    nvlink = up.latency + (node - 1) * per_peer / up.bandwidth
    nic = out.latency + (ep - node) * per_peer / out.bandwidth
    return max(nvlink, nic)


def collective_terms(
    dep: Deployment, weights: Sequence[WeightStream], layers: Sequence[Layer], g: int
) -> tuple[tuple[float, float] | None, int]:
    """Rule 4: a step's collectives: the all-reduces within an attention rank of ``g`` GPUs
    (the attention layers, and the MLP layers whose tokens no all-to-all moves) as
    ``(fixed seconds, seconds per byte)`` per step (None without any), and the number of
    all-to-alls over the experts' GPUs per step. The roofline calls it once."""
    profile, hw = dep.profile, dep.hardware
    collective: tuple[float, float] | None = None
    moe_layers = 0
    if hw.ep > 1:
        moe_layers = max((w.routing.moe_layers for w in weights if w.routing), default=0)
    num_layers = sum(layer.count for layer in layers)
    if g > 1 and profile.fabric is not None:
        fab = profile.fabric
        up = fab.scale_up
        k = fab.gpus_per_node
        calls = 2 * num_layers - moe_layers
        if g <= k:
            f = 1.0 if up.in_network_reduction else 2 * (g - 1) / g
            fixed, per_byte = up.latency, f / up.bandwidth
        else:
            out = fab.scale_out
            if out is None:  # validation guarantees this cannot happen
                raise ValueError("tp wider than a node needs fabric.scale_out")
            n = math.ceil(g / k)
            f_out = 1.0 if out.in_network_reduction else 2 * (n - 1) / n
            fixed = 2 * up.latency + out.latency
            per_byte = 2 * (k - 1) / k / up.bandwidth + f_out / k / out.bandwidth
        collective = (calls * fixed, calls * per_byte)
    return collective, 2 * moe_layers


class BatchSums:
    """Rule 1: a batch's :class:`BatchTerms` over the window and MLA classes of a
    :class:`~inference_lab.core.roofline.Roofline` (which sets the attributes below and
    inherits these methods; the engine calls them once per step)."""

    _windows: list[WindowClass]
    _mla: list[MLAClass]
    _window_sizes: list[int]
    #: the width up to which an MLA sequence decodes (absorbed form): its verify width
    decode_width: int

    def _array_terms(self, n: IntArray, c: IntArray) -> BatchTerms:
        add = np.add.reduce  # (``.sum()`` goes through a Python wrapper: twice the cost)
        sums: list[list[int]] = []
        mla: list[list[int]] = []
        tokens = int(add(n))
        if len(n):
            if tokens == len(n):  # every n is 1 (a decode batch): n . att = sum(att)
                m = c + 1
                for window, _, _ in self._windows:
                    total = int(add(np.minimum(m, window) if window > 0 else m))
                    sums.append([total, total])
            else:
                m = c + (n + 1) // 2
                for window, _, _ in self._windows:
                    att = np.minimum(m, window) if window > 0 else m
                    sums.append([int(np.dot(n, att)), int(add(att))])
            if self._mla:
                pre = n > self.decode_width
                n_pre = np.where(pre, n, 0)
                for window, _a, _e, _c, _k in self._mla:
                    att = np.minimum(m, window) if window > 0 else m
                    ctx = np.minimum(c, window) if window > 0 else c
                    mla.append(
                        [
                            int(np.dot(n, att)),
                            int(add(att)),
                            int(np.dot(n_pre, att)),
                            int(add(np.where(pre, ctx, 0))),
                        ]
                    )
        else:
            sums = [[0, 0] for _ in self._windows]
            mla = [[0, 0, 0, 0] for _ in self._mla]
        return BatchTerms(tokens, len(n), sums, mla)

    def batch_terms(self, ns: list[int] | IntArray, cs: list[int] | IntArray) -> BatchTerms:
        """What a batch given as lists (the engine's) is priced from (:class:`BatchTerms`).
        A batch of up to :data:`SMALL_BATCH` sequences is summed in Python integers,
        which for so few is several times cheaper than building arrays; the sums are the
        same integers either way, so the price is identical. int64 arrays (the engine's
        vectorised mode) are summed as arrays."""
        if isinstance(ns, np.ndarray) and isinstance(cs, np.ndarray):
            return self._array_terms(ns, cs)
        if len(ns) > SMALL_BATCH:  # (via array.array: half the cost of np.array on a list)
            return self._array_terms(
                np.frombuffer(array.array("q", ns), dtype=np.int64),
                np.frombuffer(array.array("q", cs), dtype=np.int64),
            )
        sums: list[list[int]] = []
        mids = [c + (n + 1) // 2 for n, c in zip(ns, cs, strict=True)]
        for window, _, _ in self._windows:
            att = [m if m < window else window for m in mids] if window > 0 else mids
            sums.append([sum([n * a for n, a in zip(ns, att, strict=True)]), sum(att)])
        terms = BatchTerms(sum(ns), len(ns), sums)
        if self._mla:
            width = self.decode_width
            for window, _a, _e, _c, _k in self._mla:
                row = [0, 0, 0, 0]
                for n, c, m in zip(ns, cs, mids, strict=True):
                    a = m if window <= 0 or m < window else window
                    row[0] += n * a
                    row[1] += a
                    if n > width:
                        row[2] += n * a
                        row[3] += c if window <= 0 or c < window else window
                terms.mla.append(row)
        return terms

    def window_classes(self) -> tuple[int, ...]:
        """The attention window of each class the terms sum over, in their order (0: full
        attention)."""
        return tuple(window for window, _, _ in self._windows)

    def decode_terms_of(
        self, k: int, sums: Sequence[int], ns: Sequence[int], cs: Sequence[int]
    ) -> BatchTerms:
        """The terms of a batch of ``k`` decoding sequences (one position each) followed by
        the sequences ``ns`` / ``cs``: the same integers :meth:`batch_terms` sums over all
        of them, given, per window class (:meth:`window_classes`), the sum over the
        decoding ones of ``min(c, window - 1)`` (of ``c`` for full attention), which the
        engine keeps as the sequences advance (``sum(min(c + 1, window)) =
        sum(min(c, window - 1)) + k``; ``n . att`` of a decoding sequence is ``att``)."""
        if self._mla:
            terms = BatchTerms(
                k, k, [[s + k, s + k] for s in sums], [[0, 0, 0, 0] for _ in self._mla]
            )
            for n, ci in zip(ns, cs, strict=True):
                self.add_sequence(terms, n, ci)
            return terms
        if not ns:
            pairs = []
            for s in sums:
                pairs.append([s + k, s + k])
            return BatchTerms(k, k, pairs, [])
        # add_sequence's sums, inline: integers, so in any order the same
        out = []
        for window, s in zip(self._window_sizes, sums, strict=True):
            dot = total = s + k
            for n, c in zip(ns, cs, strict=True):
                m = c + (n + 1) // 2
                att = m if window <= 0 or m < window else window
                dot += n * att
                total += att
            out.append([dot, total])
        return BatchTerms(k + sum(ns), k + len(ns), out, [])

    def add_sequence(self, terms: BatchTerms, n: int, c: int) -> None:
        """Add to ``terms`` one sequence computing ``n`` new positions on top of ``c``:
        the terms are sums over the sequences, so they become exactly those of the batch
        with it (a late arrival joining the step in flight is priced in O(1))."""
        terms.tokens += n
        terms.seqs += 1
        m = c + (n + 1) // 2
        for (window, _, _), sums in zip(self._windows, terms.sums, strict=True):
            att = m if window <= 0 or m < window else window
            sums[0] += n * att
            sums[1] += att
        for (window, _a, _e, _c, _k), row in zip(self._mla, terms.mla, strict=True):
            att = m if window <= 0 or m < window else window
            row[0] += n * att
            row[1] += att
            if n > self.decode_width:
                row[2] += n * att
                row[3] += c if window <= 0 or c < window else window

    def has_mla(self) -> bool:
        """Whether the model has MLA layers (their terms need each sequence's ``n``)."""
        return bool(self._mla)


class KvBlocks:
    """Rule 3: the KV blocks a sequence holds, for a
    :class:`~inference_lab.core.roofline.Roofline` (which sets the attributes below and
    inherits these methods; the engine and the serving layer's fit check call them)."""

    block_size: int
    block_bytes: float
    _state_bytes: float
    _windowed_kv: list[tuple[int, float]]
    _private_table: list[int]

    def _private_block_table(self) -> list[int]:
        """The private blocks by resident positions, up to the widest window (constant
        beyond): what ``_private_table`` holds."""
        widest = max((w for w, _ in self._windowed_kv), default=0)
        return [self._private_blocks(t) for t in range(widest + 1)]

    def _private_blocks(self, positions: int) -> int:
        private = self._state_bytes + sum(
            kvpp * min(positions, window) for window, kvpp in self._windowed_kv
        )
        return math.ceil(private / self.block_bytes)

    def blocks_for(self, positions: int) -> int:
        """KV blocks a request holding ``positions`` resident positions needs: content
        blocks plus private blocks (windowed KV and recurrent state; a table, since the
        engine asks once per running request per step and windows saturate)."""
        content = -(-positions // self.block_size)
        table = self._private_table
        return content + table[positions if positions < len(table) else -1]

    def flat_blocks(self) -> tuple[int, int]:
        """``(p0, tail)``: from ``p0`` positions on, ``blocks_for(p) = ceil(p /
        block_size) + tail`` (the private blocks stay ``tail``), and ``room_for(b) = (b -
        tail) * block_size`` whenever that is at least ``p0``."""
        table = self._private_table
        return len(table) - 1, table[-1]

    def room_for(self, blocks: int) -> int:
        """The most resident positions ``blocks`` KV blocks hold: the largest ``p`` with
        ``blocks_for(p) <= blocks`` (0 when not even one position fits). ``blocks_for`` is
        non-decreasing, so a request holding ``blocks`` needs no new block while its
        positions stay within this; the engine asks once per block a request grows by."""
        bs = self.block_size
        table = self._private_table
        last = len(table) - 1
        p = (blocks - table[last]) * bs  # past the table, private blocks no longer grow
        if p >= last:
            return p
        if table[0] > blocks:  # blocks_for(0): not even the private blocks fit
            return 0
        lo, hi = 0, last  # blocks_for(hi) > blocks; find the largest p < hi that fits
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if self.blocks_for(mid) <= blocks:
                lo = mid
            else:
                hi = mid
        return lo

    def has_private_blocks(self) -> bool:
        return bool(self._windowed_kv) or self._state_bytes > 0
