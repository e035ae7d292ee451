"""The step-cost model: what one engine step costs on one deployment.

Rule 1: a step is priced from datasheet peaks scaled by the deployment's efficiency. Each
        precision stream costs ``max(FLOPs[p] / (R_p * eta_flops), Bytes[p] / (BW *
        eta_bw))``; streams are summed (serial kernels); collectives and the fixed
        ``step_overhead`` are added serially; ``alpha * t + beta`` applies last. With the
        default efficiency (1.0, 1.0, 0 s) every price is the datasheet roofline's, to
        the last bit.
Rule 2: a batch's price depends on it only through integer sums over its sequences
        (:class:`BatchTerms`), taken once per batch: with numpy over arrays for a large
        batch, in Python integers for a small one; nothing loops per request per layer.
        A sequence joining a priced batch adds its own terms.
Rule 3: KV capacity and ``blocks_for`` are pure functions of the deployment; the engine's
        block accounting and the serving layer's fit check both use them.
Rule 4: with a measured step table (:mod:`inference_lab.core.step_table`) a step inside
        the table's box costs the interpolated measurement (time_correction does not
        apply: it is measured); outside, the measurement at the nearest point of the box
        times the ratio of Rule 1's prices of the step and of that point, both taken for
        the even batch the table's coordinates describe.
"""

from __future__ import annotations

import array
import math
from collections.abc import Sequence
from typing import Any

import attrs
import numpy as np

from inference_lab.core.config import BYTES_PER_VALUE, AttentionLayer, Deployment, LinearLayer
from inference_lab.core.step_table import StepTable

IntArray = np.ndarray[Any, np.dtype[np.int64]]


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


#: Batches of at most this many sequences are priced in Python integers (``batch_terms``).
SMALL_BATCH = 32


@attrs.define(slots=True)
class BatchTerms:
    """What a step's price depends on: its token count, its sequence count and, per
    attention window class of the model (ascending windows, full attention first as 0),
    the sums over its sequences of ``n * att`` and of ``att`` (``att`` = the positions a
    sequence attends at its chunk's midpoint, capped by the window). All integers, so
    adding a sequence (:meth:`Roofline.add_sequence`) gives exactly the terms of the
    batch with it."""

    tokens: int
    seqs: int
    sums: list[list[int]]


def expert_read_fraction(num_experts: int, k: int, tokens: int) -> float:
    """Expected distinct experts touched when ``tokens`` tokens each pick ``k`` of E."""
    return float(num_experts * (1.0 - (1.0 - 1.0 / num_experts) ** (k * tokens)))


class Roofline:
    """Prices engine steps for one deployment. Built once per engine; ``step_cost`` is the
    hot path called once per engine step."""

    def __init__(self, dep: Deployment) -> None:
        model, profile, hw = dep.model, dep.profile, dep.hardware
        tp = hw.tp
        self.deployment = dep
        self.alpha = hw.time_correction.alpha
        self.beta = hw.time_correction.beta
        eff = dep.efficiency
        self._eta_flops = eff.flops
        self._eta_bw = eff.memory_bandwidth
        self._overhead = eff.step_overhead
        self._table: StepTable | None = dep.step_table
        #: achievable bytes/s of one replica (datasheet x tp x efficiency)
        self.bandwidth = profile.memory_bandwidth * tp * eff.memory_bandwidth
        self.block_size = dep.scheduler.block_size
        self.block_bytes = dep.block_bytes
        self.total_blocks = dep.total_blocks
        precisions = sorted({w.precision for w in model.weights} | {model.attention_precision})
        self._index = {p: i for i, p in enumerate(precisions)}
        rates = []
        for p in precisions:
            rate = profile.flops(p)
            if rate is None:  # config validation guarantees this cannot happen
                raise ValueError(f"no FLOP rate for {p} in profile {profile.name}")
            rates.append(rate * tp * eff.flops)
        self._rates = rates
        self._attn_idx = self._index[model.attention_precision]
        # weight streams: (precision index, active, routing terms or None)
        self._weights: list[tuple[int, float, float, tuple[float, float, int, int] | None]] = []
        for w in model.weights:
            b = BYTES_PER_VALUE[w.precision]
            routed = None
            if w.routing is not None and w.routing.routed_experts > w.routing.experts_per_tok:
                e, k = w.routing.routed_experts, w.routing.experts_per_tok
                per_expert = (w.resident_params - w.active_params) / (e - k)
                shared = max(0.0, w.active_params - k * per_expert)
                routed = (shared, per_expert, e, k)
            self._weights.append((self._index[w.precision], w.active_params, b, routed))
        # attention / KV / state, grouped by window so the batch is touched once per group
        attn_flops: dict[int, float] = {}  # window -> Σ count·4·heads·head_dim
        kv_bytes: dict[int, float] = {}  # window -> Σ count·kvpp
        state = 0.0
        for layer in model.layers:
            if isinstance(layer, AttentionLayer):
                attn_flops[layer.window] = attn_flops.get(layer.window, 0.0) + (
                    layer.count * 4 * layer.heads * layer.head_dim
                )
                kv_bytes[layer.window] = kv_bytes.get(layer.window, 0.0) + (
                    layer.count * layer.kv_bytes_per_position
                )
            elif isinstance(layer, LinearLayer):
                state += layer.count * layer.state_bytes
        self._windows = [(w, attn_flops[w], kv_bytes[w]) for w in sorted(attn_flops)]
        self._state_bytes = state
        self._windowed_kv = [(w, kv_bytes[w]) for w in sorted(kv_bytes) if w > 0]
        # private blocks by resident positions, up to the widest window (constant beyond)
        widest = max((w for w, _ in self._windowed_kv), default=0)
        self._private_table = [self._private_blocks(t) for t in range(widest + 1)]
        # collectives
        self._collective: tuple[float, float] | None = None  # (fixed, per byte) per step
        self._message_per_token = model.hidden_dim * model.activation_bytes
        if tp > 1 and profile.fabric is not None:
            fab = profile.fabric
            up = fab.scale_up
            k = fab.gpus_per_node
            calls = 2 * model.num_layers
            if tp <= k:
                f = 1.0 if up.in_network_reduction else 2 * (tp - 1) / tp
                fixed, per_byte = up.latency, f / up.bandwidth
            else:
                out = fab.scale_out
                if out is None:  # validation guarantees this cannot happen
                    raise ValueError("tp wider than a node needs fabric.scale_out")
                n = math.ceil(tp / k)
                f_out = 1.0 if out.in_network_reduction else 2 * (n - 1) / n
                fixed = 2 * up.latency + out.latency
                per_byte = 2 * (k - 1) / k / up.bandwidth + f_out / k / out.bandwidth
            self._collective = (calls * fixed, calls * per_byte)
        self._by_tokens: dict[int, tuple[tuple[float, ...], tuple[float, ...], float]] = {}

    # ----------------------------------------------------------------------------------
    def weight_read(self, tokens: int) -> list[float]:
        """Bytes read from HBM by each weight stream (in ``model.weights`` order) for a step
        of ``tokens`` tokens: a dense stream reads its active parameters; a routed (MoE)
        stream its shared part plus the experts the tokens touch
        (:func:`expert_read_fraction`). ``step_cost`` prices its memory time with it."""
        out = []
        for _idx, active, b, routed in self._weights:
            if routed is None or tokens == 0:
                out.append(b * active)
            else:
                shared, per_expert, e, k = routed
                out.append(b * (shared + per_expert * expert_read_fraction(e, k, tokens)))
        return out

    def collective_time(self, tokens: int) -> float:
        if self._collective is None or tokens == 0:
            return 0.0
        fixed, per_byte = self._collective
        return fixed + per_byte * tokens * self._message_per_token

    def step_cost(self, n: IntArray, c: IntArray) -> StepCost:
        """Price a batch: request i computes ``n[i]`` new positions on top of ``c[i]``."""
        return self.price(self._array_terms(n, c))

    def _array_terms(self, n: IntArray, c: IntArray) -> BatchTerms:
        add = np.add.reduce  # (``.sum()`` goes through a Python wrapper: twice the cost)
        sums: list[list[int]] = []
        if len(n):
            m = c + (n + 1) // 2
            for window, _, _ in self._windows:
                att = np.minimum(m, window) if window > 0 else m
                sums.append([int(np.dot(n, att)), int(add(att))])
        else:
            sums = [[0, 0] for _ in self._windows]
        return BatchTerms(int(add(n)), len(n), sums)

    def batch_terms(self, ns: list[int], cs: list[int]) -> BatchTerms:
        """What a batch given as lists (the engine's) is priced from (:class:`BatchTerms`).
        A batch of up to :data:`SMALL_BATCH` sequences is summed in Python integers,
        which for so few is several times cheaper than building arrays; the sums are the
        same integers either way, so the price is identical."""
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
        return BatchTerms(sum(ns), len(ns), sums)

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

    def price(self, terms: BatchTerms) -> StepCost:
        """The cost of the batch ``terms`` sums up."""
        if self._table is not None and terms.seqs:
            return self._table_price(terms)
        return self._price(terms.tokens, terms.seqs, terms.sums)

    def _table_price(self, terms: BatchTerms) -> StepCost:
        """Rule 4: the step table's price of the batch ``terms`` sums up."""
        table = self._table
        assert table is not None
        b, p = terms.seqs, terms.tokens - terms.seqs
        c = terms.sums[0][1] / b  # window classes ascend: the first is full attention
        point = table.clamp(b, p, c)
        seconds = table.interpolate(*point)
        if point != (b, p, c):
            seconds *= self.even_price(b, p, c) / self.even_price(*point)
        cost = self._price(terms.tokens, terms.seqs, terms.sums)
        return StepCost(seconds, seconds, cost.compute, cost.memory)

    def even_price(self, batch: float, prefill: float, context: float) -> float:
        """Rule 1's price (seconds, time_correction included, no step table) of the even
        batch a step table's coordinates describe: ``batch`` sequences computing
        ``batch + prefill`` tokens in all, each attending ``context`` positions (capped by
        each window class)."""
        tokens = round(batch + prefill)
        sums: list[list[float]] = []
        for window, _, _ in self._windows:
            att = min(context, window) if window > 0 else context
            sums.append([tokens * att, batch * att])
        return self._price(tokens, round(batch), sums).seconds

    def _price(self, tokens: int, nreq: int, sums: Sequence[Sequence[float]]) -> StepCost:
        """The step's cost from its token count, its sequence count and, per attention
        window class (``_windows`` order), the sums over its sequences of ``n * att`` and
        of ``att`` (``att`` = the positions attended at the chunk's midpoint, capped by
        the window)."""
        fixed = self._by_tokens.get(tokens)
        if fixed is None:
            fixed = self._by_tokens[tokens] = self._token_terms(tokens)
        flops, mem, collective = list(fixed[0]), list(fixed[1]), fixed[2]
        if nreq:
            a = self._attn_idx
            for (_window, attn_coef, kv_coef), (dot, total) in zip(
                self._windows, sums, strict=True
            ):
                flops[a] += attn_coef * float(dot)
                mem[a] += kv_coef * float(total)
            mem[a] += self._state_bytes * nreq
        compute = memory = roof = 0.0
        bw = self.bandwidth
        for rate, f, byt in zip(self._rates, flops, mem, strict=True):
            tc = f / rate
            tm = byt / bw
            compute += tc
            memory += tm
            roof += tc if tc > tm else tm
        roof += collective + self._overhead
        # compute and memory at datasheet peaks (x 1.0 is exact: the defaults move nothing)
        return StepCost(
            self.alpha * roof + self.beta,
            roof,
            compute * self._eta_flops,
            memory * self._eta_bw,
        )

    def _token_terms(self, tokens: int) -> tuple[tuple[float, ...], tuple[float, ...], float]:
        """What a step's price owes to its token count alone: the flops and bytes of each
        rate class from the weights, and the collectives' time (kept per count in
        ``_by_tokens``: a step's count is at most ``max_num_batched_tokens``)."""
        flops = [0.0] * len(self._rates)
        mem = [0.0] * len(self._rates)
        for (idx, active, _b, _routed), read in zip(
            self._weights, self.weight_read(tokens), strict=True
        ):
            flops[idx] += 2.0 * active * tokens
            mem[idx] += read
        return tuple(flops), tuple(mem), self.collective_time(tokens)

    def step_time(self, n: IntArray, c: IntArray) -> float:
        """Seconds for the batch, after time_correction."""
        return self.step_cost(n, c).seconds

    # ----------------------------------------------------------------------------------
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
