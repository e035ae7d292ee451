"""The step-cost model: what one engine step costs on one deployment.

Rule 1: a step is priced from datasheet peaks scaled by the deployment's efficiency. Each
        precision stream costs ``max(FLOPs[p] / (R_p * eta_flops), Bytes[p] / (BW *
        eta_bw))``; streams are summed (serial kernels); collectives, the fixed
        ``step_overhead`` and ``[overheads] seq_overhead`` per sequence in the step are
        added serially; ``alpha * t + beta`` applies last. With the default efficiency
        (1.0, 1.0, 0 s) and overheads (0 s) every price is the datasheet roofline's, to the
        last bit.
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
Rule 5: an MLA layer's attention FLOPs are summed apart for decode sequences (at most the
        verify width of positions: the absorbed form) and prefill chunks (the expanded
        form, plus the up-projection of their cached context); its KV bytes are the
        latent's, as every layer's are.
Rule 6: with data-parallel attention a replica's step is its ranks' lockstep step: the
        slowest rank's own part (dense weights, attention, its all-reduces) plus the
        experts' part over all the ranks' tokens and the all-to-alls, priced once.
Rule 7: a speculative step costs its verify batch (each decoding sequence at its verify
        width) plus its drafter, added before time_correction; without ``[speculative]``
        or MLA layers and with ``ep`` and ``dp_attention`` at 1, every price is the one
        Rules 1-4 give, to the last bit.
Rule 8: a routed (MoE) stream reads the experts its step's tokens touch: under uniform
        routing ``E (1 - (1 - 1/E)^(kT))`` of them for ``T`` tokens picking ``k`` of ``E``;
        with ``[efficiency] expert_skew`` s > 0 the experts' popularity falls as a Zipf
        law (:func:`zipf_coverage`): real routers send more tokens to some experts, so a
        batch touches fewer of them. At 0 every price is the uniform one, to the bit.
Rule 9: ``[efficiency] layer_overhead`` adds its time once per transformer layer to every
        step, beside ``step_overhead`` (each layer's kernels and tensor-parallel
        synchronisation, which a deeper model pays more of); at 0 every price is the one
        Rules 1-8 give, to the bit.
"""

from __future__ import annotations

from collections.abc import Sequence

from inference_lab.core.config import (
    BYTES_PER_VALUE,
    Deployment,
    Layer,
    SpeculativeConfig,
    WeightStream,
)
from inference_lab.core.decode_pricing import DecodeConstants, DecodePricer, decode_price_function
from inference_lab.core.roofline_terms import (
    SMALL_BATCH,
    BatchSums,
    BatchTerms,
    IntArray,
    KvBlocks,
    StepCost,
    _step_cost,
    all_to_all_time,
    collective_terms,
    layer_classes,
    mla_flop_coefficients,
    zipf_coverage,
)
from inference_lab.core.step_table import StepTable

__all__ = [
    "SMALL_BATCH",
    "BatchTerms",
    "IntArray",
    "Roofline",
    "StepCost",
    "all_to_all_time",
    "expert_read_fraction",
    "mla_flop_coefficients",
]


def expert_read_fraction(num_experts: int, k: int, tokens: int, skew: float = 0.0) -> float:
    """Expected distinct experts touched when ``tokens`` tokens each pick ``k`` of E
    (Rule 8: uniform routing at ``skew`` 0, else :func:`zipf_coverage`)."""
    if skew == 0.0:
        return float(num_experts * (1.0 - (1.0 - 1.0 / num_experts) ** (k * tokens)))
    return zipf_coverage(num_experts, k, tokens, skew)


class Roofline(BatchSums, KvBlocks):
    """Prices engine steps for one deployment. Built once per engine; ``price`` is the
    hot path called once per engine step. The batch's terms (``batch_terms``,
    ``add_sequence``, ...) and its KV blocks (``blocks_for``, ``room_for``, ...) come
    from :mod:`.roofline_terms`.

    ``weights`` and ``layers`` replace the model's (a drafter is priced so, ``drafting``:
    no per-step overhead, no step table, no drafter of its own, one attention rank)."""

    def __init__(
        self,
        dep: Deployment,
        *,
        weights: tuple[WeightStream, ...] | None = None,
        layers: tuple[Layer, ...] | None = None,
        drafting: bool = False,
    ) -> None:
        model, profile, hw = dep.model, dep.profile, dep.hardware
        weights = model.weights if weights is None else weights
        layers = model.layers if layers is None else layers
        tp = hw.tp
        dp = 1 if drafting else hw.dp_attention
        g = tp // dp  # the GPUs of one attention rank (all of them without DP attention)
        self.deployment = dep
        self.dp = dp
        self.alpha = hw.time_correction.alpha
        self.beta = hw.time_correction.beta
        eff = dep.efficiency
        self._eta_flops = eff.flops
        self._eta_bw = eff.memory_bandwidth
        self._skew = eff.expert_skew
        # Rule 9: the fixed time of a step, and of each of its transformer layers
        self._overhead = (
            0.0
            if drafting
            else eff.step_overhead + eff.layer_overhead * sum(x.count for x in layers)
        )
        #: the host's work per sequence in a step (0: none, and nothing is added)
        self._seq_overhead = 0.0 if drafting else dep.overheads.seq_overhead
        self._table: StepTable | None = None if drafting else dep.step_table
        #: achievable bytes/s of one attention rank (datasheet x GPUs x efficiency)
        self.bandwidth = profile.memory_bandwidth * g * eff.memory_bandwidth
        self.block_size = dep.scheduler.block_size
        self.block_bytes = dep.block_bytes
        self.total_blocks = dep.total_blocks
        self._set_rates(weights, g)
        self._set_weights(weights)
        # attention / KV / state, grouped by window so the batch is touched once per group
        classes = layer_classes(dep, layers)
        self._windows = classes.windows
        self._mla = classes.mla
        self._state_bytes = classes.state_bytes
        self._windowed_kv = classes.windowed_kv
        self._private_table = self._private_block_table()
        spec = None if drafting else dep.speculative
        self.decode_width = 1 if spec is None else 1 + spec.num_speculative_tokens
        self._collective, self._a2a_calls = collective_terms(dep, weights, layers, g)
        self._message_per_token = model.hidden_dim * model.activation_bytes
        self._set_caches()
        self._set_drafter(spec)

    def _set_rates(self, weights: tuple[WeightStream, ...], g: int) -> None:
        """The precision classes (the weights' and attention's, sorted) and their
        achievable FLOP/s: of one attention rank (``g`` GPUs) and, for the experts under
        data-parallel attention, of the whole replica."""
        dep = self.deployment
        profile, eff, tp = dep.profile, dep.efficiency, dep.hardware.tp
        attention_precision = dep.model.attention_precision
        precisions = sorted({w.precision for w in weights} | {attention_precision})
        self._index = {p: i for i, p in enumerate(precisions)}
        rates = []
        peaks = []
        for p in precisions:
            rate = profile.flops(p)
            if rate is None:  # config validation guarantees this cannot happen
                raise ValueError(f"no FLOP rate for {p} in profile {profile.name}")
            rates.append(rate * g * eff.flops)
            peaks.append(rate * tp * eff.flops)
        self._rates = rates
        self._attn_idx = self._index[attention_precision]
        self._expert_rates = peaks
        self._expert_bandwidth = profile.memory_bandwidth * tp * eff.memory_bandwidth

    def _set_weights(self, weights: tuple[WeightStream, ...]) -> None:
        """The weight streams: (precision index, active, bytes per value, routing terms or
        None); with DP attention the routed experts are priced apart (``_experts``), over
        every GPU. ``_moe_k``: the most experts a token picks."""
        self._weights: list[tuple[int, float, float, tuple[float, float, int, int] | None]] = []
        self._experts: list[tuple[int, float, float, int, int]] = []
        moe_k = 0
        for w in weights:
            b = BYTES_PER_VALUE[w.precision]
            routed = None
            if w.routing is not None and w.routing.routed_experts > w.routing.experts_per_tok:
                e, k = w.routing.routed_experts, w.routing.experts_per_tok
                per_expert = (w.resident_params - w.active_params) / (e - k)
                shared = max(0.0, w.active_params - k * per_expert)
                routed = (shared, per_expert, e, k)
            if w.routing is not None:
                moe_k = max(moe_k, w.routing.experts_per_tok)
            idx = self._index[w.precision]
            if self.dp > 1 and routed is not None:
                shared, per_expert, e, k = routed
                self._weights.append((idx, shared, b, None))
                self._experts.append((idx, k * per_expert, b * per_expert, e, k))
            else:
                self._weights.append((idx, w.active_params, b, routed))
        self._moe_k = moe_k

    def _set_caches(self) -> None:
        """The per-token-count caches and the constants of :meth:`_plain_price`."""
        self._by_tokens: dict[int, tuple[tuple[float, ...], tuple[float, ...], float]] = {}
        #: :meth:`price`'s common case: no step table, no MLA class, no DP attention
        self._plain = self._table is None and not self._mla and self.dp == 1
        #: :meth:`_plain_price` where :meth:`price` is it, for callers that skip the dispatch
        self.plain_price = self._plain_price if self._plain else None
        self._plain_by_tokens: dict[
            int, tuple[float, float, float, list[tuple[float, float]], list[tuple[float, float]]]
        ] = {}
        self._coefs = [(attn_coef, kv_coef) for _, attn_coef, kv_coef in self._windows]
        self._window_sizes = [window for window, _, _ in self._windows]
        self._coef_pair = (self._coefs[0], self._coefs[1]) if len(self._coefs) == 2 else None
        self._attn_rate = self._rates[self._attn_idx]
        self._experts_by_tokens: dict[int, tuple[float, float, float]] = {}

    def _set_drafter(self, spec: SpeculativeConfig | None) -> None:
        """The drafter of a speculative deployment: a fraction of the target's pass, or a
        roofline of its own (a draft model or MTP head)."""
        self.speculative = spec
        self._fraction = 0.0
        self._draft: Roofline | None = None
        if spec is not None:
            drafter = spec.drafter
            if drafter.kind == "fraction":
                assert drafter.fraction is not None  # validated
                self._fraction = drafter.fraction
            else:
                self._draft = Roofline(
                    self.deployment, weights=drafter.weights, layers=drafter.layers, drafting=True
                )

    # ----------------------------------------------------------------------------------
    def weight_read(self, tokens: int) -> list[float]:
        """Bytes read from HBM by each weight stream (in ``model.weights`` order) for a step
        of ``tokens`` tokens: a dense stream reads its active parameters; a routed (MoE)
        stream its shared part plus the experts the tokens touch
        (:func:`expert_read_fraction`). ``step_cost`` prices its memory time with it. With
        data-parallel attention, a routed stream's part here is its shared part (its
        experts are :meth:`expert_time`'s)."""
        out = []
        for _idx, active, b, routed in self._weights:
            if routed is None or tokens == 0:
                out.append(b * active)
            else:
                shared, per_expert, e, k = routed
                out.append(
                    b * (shared + per_expert * expert_read_fraction(e, k, tokens, self._skew))
                )
        return out

    def collective_time(self, tokens: int) -> float:
        """The all-reduces of a step of ``tokens`` tokens (of one attention rank) and, without
        data-parallel attention, its MoE layers' all-to-alls."""
        if tokens == 0:
            return 0.0
        total = 0.0
        if self._collective is not None:
            fixed, per_byte = self._collective
            total = fixed + per_byte * tokens * self._message_per_token
        if self._a2a_calls and self.dp == 1:
            total += self._a2a_calls * all_to_all_time(self.deployment, tokens, self._moe_k)
        return total

    def expert_time(self, tokens: int) -> tuple[float, float, float]:
        """Data-parallel attention (Rule 6): the experts' part of a lockstep step whose ranks
        hold ``tokens`` tokens in all, over every GPU of the replica: its roofline time (each
        precision at the larger of compute and memory), its compute and memory times, with
        the MoE layers' all-to-alls in the first."""
        cached = self._experts_by_tokens.get(tokens)
        if cached is not None:
            return cached
        flops = [0.0] * len(self._rates)
        mem = [0.0] * len(self._rates)
        if tokens:
            for idx, active, per_expert_bytes, e, k in self._experts:
                flops[idx] += 2.0 * active * tokens
                mem[idx] += per_expert_bytes * expert_read_fraction(e, k, tokens, self._skew)
        roof = compute = memory = 0.0
        bw = self._expert_bandwidth
        for rate, f, byt in zip(self._expert_rates, flops, mem, strict=True):
            tc, tm = f / rate, byt / bw
            compute += tc
            memory += tm
            roof += tc if tc > tm else tm
        roof += self._a2a_calls * all_to_all_time(self.deployment, tokens, self._moe_k)
        out = (roof, compute, memory)
        self._experts_by_tokens[tokens] = out
        return out

    def step_cost(self, n: IntArray, c: IntArray) -> StepCost:
        """Price a batch: request i computes ``n[i]`` new positions on top of ``c[i]``."""
        return self.price(self._array_terms(n, c))

    def price(self, terms: BatchTerms) -> StepCost:
        """The cost of the batch ``terms`` sums up (with data-parallel attention, a step in
        which one rank runs it and the others idle: :meth:`group_price`)."""
        if self._plain:
            return self._plain_price(terms.tokens, terms.seqs, terms.sums)
        if self._table is not None and terms.seqs:
            return self._table_price(terms)
        if self.dp > 1:
            return self.group_price((terms,))
        return self._price(terms.tokens, terms.seqs, terms.sums, terms.mla)

    def _plain_price(self, tokens: int, nreq: int, sums: Sequence[Sequence[int]]) -> StepCost:
        """:meth:`_price` without a step table, MLA classes or data-parallel attention (the
        common case, priced every step): the same operations on the same floats in the
        same order, so the same bits, with the weight streams' own times (the streams
        but attention's) taken once per token count."""
        fixed = self._plain_by_tokens.get(tokens)
        if fixed is None:
            fixed = self._plain_by_tokens[tokens] = self._plain_terms(tokens)
        fa, ma, collective, before, after = fixed
        if nreq:
            pair = self._coef_pair
            if pair is not None:  # two window classes (a sliding window and full), unrolled
                (a0, k0), (a1, k1) = pair
                (dot0, total0), (dot1, total1) = sums
                fa += a0 * float(dot0)
                ma += k0 * float(total0)
                fa += a1 * float(dot1)
                ma += k1 * float(total1)
            else:
                for (attn_coef, kv_coef), (dot, total) in zip(self._coefs, sums, strict=True):
                    fa += attn_coef * float(dot)
                    ma += kv_coef * float(total)
            ma += self._state_bytes * nreq
        compute = memory = roof = 0.0
        for tc, tm in before:  # the streams in _rates order: those before attention's,
            compute += tc
            memory += tm
            roof += tc if tc > tm else tm
        tc = fa / self._attn_rate  # attention's,
        tm = ma / self.bandwidth
        compute += tc
        memory += tm
        roof += tc if tc > tm else tm
        for tc, tm in after:  # and those after it
            compute += tc
            memory += tm
            roof += tc if tc > tm else tm
        roof += collective + self._overhead
        if self._seq_overhead:
            roof += self._seq_overhead * nreq
        return _step_cost(
            self.alpha * roof + self.beta,
            roof,
            compute * self._eta_flops,
            memory * self._eta_bw,
        )

    def decode_pricer(self, rows: int) -> DecodePricer | None:
        """For steps of ``rows`` decoding sequences and nothing else (each window class's
        ``n . att`` equals its ``att`` sum): a function from the per-class sums to
        ``(seconds, roofline, compute, memory)``, the floats :meth:`price` gives for
        ``BatchTerms(rows, rows, [[t, t] for t in sums])``, to the bit -- its constants
        taken once, for a run of such steps (the engine's decode runs). None where the
        price is not :meth:`_plain_price`'s (a step table, MLA classes, data-parallel
        attention) or for no rows."""
        k = self.decode_constants(rows)
        return None if k is None else decode_price_function(k)

    def decode_constants(self, rows: int) -> DecodeConstants | None:
        """The constants of :meth:`decode_pricer`'s function for ``rows`` (None where it
        gives none); the engine's decode runs also unroll them into their stretches."""
        if not self._plain or rows <= 0:
            return None
        fixed = self._plain_by_tokens.get(rows)
        if fixed is None:
            fixed = self._plain_by_tokens[rows] = self._plain_terms(rows)
        fa0, ma0, collective, before, after = fixed
        compute0 = memory0 = roof0 = 0.0
        for tc, tm in before:  # the streams before attention's, in order (as _plain_price)
            compute0 += tc
            memory0 += tm
            roof0 += tc if tc > tm else tm
        return DecodeConstants(
            fa0=fa0,
            ma0=ma0,
            coefs=tuple(self._coefs),
            state=self._state_bytes * rows,
            attn_rate=self._attn_rate,
            bandwidth=self.bandwidth,
            compute0=compute0,
            memory0=memory0,
            roof0=roof0,
            after=tuple(after),
            tail=collective + self._overhead,
            seq=self._seq_overhead * rows,
            alpha=self.alpha,
            beta=self.beta,
            eta_flops=self._eta_flops,
            eta_bw=self._eta_bw,
        )

    def _plain_terms(
        self, tokens: int
    ) -> tuple[float, float, float, list[tuple[float, float]], list[tuple[float, float]]]:
        """For :meth:`_plain_price`: the attention stream's flops and bytes owed to the
        token count, the collectives' time, and the compute and memory times of the
        streams before and after attention's, in order (attention's are worked out per
        step)."""
        fixed = self._by_tokens.get(tokens)
        if fixed is None:
            fixed = self._by_tokens[tokens] = self._token_terms(tokens)
        flops, mem, collective = fixed
        a = self._attn_idx
        bw = self.bandwidth
        times = [(f / rate, byt / bw) for rate, f, byt in zip(self._rates, flops, mem, strict=True)]
        return flops[a], mem[a], collective, times[:a], times[a + 1 :]

    def group_price(self, ranks: Sequence[BatchTerms]) -> StepCost:
        """Data-parallel attention (Rule 6): the lockstep step of a replica's ranks, each
        computing its own batch ``ranks[i]``: the slowest rank's own part, then the
        experts over all their tokens and the all-to-alls, the overhead, time_correction."""
        slowest = (0.0, 0.0, 0.0)
        tokens = seqs = 0
        for terms in ranks:
            tokens += terms.tokens
            seqs += terms.seqs
            streams, collective, compute, memory = self._roof(
                terms.tokens, terms.seqs, terms.sums, terms.mla
            )
            if streams + collective > slowest[0]:
                slowest = (streams + collective, compute, memory)
        experts = self.expert_time(tokens)
        roof = slowest[0] + experts[0] + self._overhead
        if self._seq_overhead:
            roof += self._seq_overhead * seqs
        return StepCost(
            self.alpha * roof + self.beta,
            roof,
            (slowest[1] + experts[1]) * self._eta_flops,
            (slowest[2] + experts[2]) * self._eta_bw,
        )

    def _table_price(self, terms: BatchTerms) -> StepCost:
        """Rule 4: the step table's price of the batch ``terms`` sums up."""
        table = self._table
        assert table is not None
        b, p = terms.seqs, terms.tokens - terms.seqs
        # window classes ascend: the first is full attention
        c = (terms.sums[0][1] if terms.sums else terms.mla[0][1]) / b
        point = table.clamp(b, p, c)
        seconds = table.interpolate(*point)
        if point != (b, p, c):
            seconds *= self.even_price(b, p, c) / self.even_price(*point)
        cost = self._price(terms.tokens, terms.seqs, terms.sums, terms.mla)
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
        mla: list[list[float]] = []
        prefilling = batch > 0 and tokens / batch > self.decode_width
        for window, _a, _e, _c, _k in self._mla:
            att = min(context, window) if window > 0 else context
            dot = tokens * att
            mla.append([dot, batch * att, dot if prefilling else 0.0, 0.0])
        return self._price(tokens, round(batch), sums, mla).seconds

    def _price(
        self,
        tokens: int,
        nreq: int,
        sums: Sequence[Sequence[float]],
        mla: Sequence[Sequence[float]] = (),
    ) -> StepCost:
        """The step's cost from its token count, its sequence count and, per attention
        window class (``_windows`` order), the sums over its sequences of ``n * att`` and
        of ``att`` (``att`` = the positions attended at the chunk's midpoint, capped by
        the window); per MLA class, :class:`BatchTerms`' four sums. With data-parallel
        attention, one rank's step on its own (:meth:`group_price` adds the experts)."""
        roof, collective, compute, memory = self._roof(tokens, nreq, sums, mla)
        roof += collective + self._overhead
        if self._seq_overhead:
            roof += self._seq_overhead * nreq
        # compute and memory at datasheet peaks (x 1.0 is exact: the defaults move nothing)
        return StepCost(
            self.alpha * roof + self.beta,
            roof,
            compute * self._eta_flops,
            memory * self._eta_bw,
        )

    def _roof(
        self,
        tokens: int,
        nreq: int,
        sums: Sequence[Sequence[float]],
        mla: Sequence[Sequence[float]],
    ) -> tuple[float, float, float, float]:
        """Rule 1 without the overhead and time_correction: the streams' roofline time (each
        at the larger of compute and memory), the collectives' time, the compute time and
        the memory time."""
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
            if self._mla:
                self._add_mla(flops, mem, mla)
            mem[a] += self._state_bytes * nreq
        compute = memory = roof = 0.0
        bw = self.bandwidth
        for rate, f, byt in zip(self._rates, flops, mem, strict=True):
            tc = f / rate
            tm = byt / bw
            compute += tc
            memory += tm
            roof += tc if tc > tm else tm
        return roof, collective, compute, memory

    def _add_mla(
        self, flops: list[float], mem: list[float], mla: Sequence[Sequence[float]]
    ) -> None:
        """Rule 5: the MLA classes' attention FLOPs (absorbed for decode sequences, expanded
        for prefill chunks and their context's up-projection) and KV bytes."""
        a = self._attn_idx
        for (_window, absorbed, expanded, context, kv_coef), (dot, total, dot_pre, ctx_pre) in zip(
            self._mla, mla, strict=True
        ):
            flops[a] += (
                absorbed * float(dot - dot_pre)
                + expanded * float(dot_pre)
                + context * float(ctx_pre)
            )
            mem[a] += kv_coef * float(total)

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
    def draft_time(
        self,
        plain: float,
        plain_ns: list[int],
        plain_cs: list[int],
        drafting_cs: list[int],
        gamma: int,
    ) -> float:
        """Rule 7: the drafter's seconds (before time_correction) for a step whose
        drafting sequences (their contexts ``drafting_cs``) propose ``gamma`` tokens each.
        ``fraction``: gamma times ``fraction`` of ``plain``, the target's roofline time of
        the batch without drafts. A draft model or MTP head: one pass over the batch
        without drafts (``plain_ns`` / ``plain_cs``: each decoding sequence one position,
        prefill chunks whole), then ``gamma - 1`` passes of one position per drafting
        sequence."""
        if gamma <= 0 or not drafting_cs:
            return 0.0
        draft = self._draft
        if draft is None:
            return self._fraction * gamma * plain
        seconds = draft.pass_time(draft.batch_terms(plain_ns, plain_cs))
        if gamma > 1:
            later = draft.batch_terms([1] * len(drafting_cs), [c + 1 for c in drafting_cs])
            seconds += (gamma - 1) * draft.pass_time(later)
        return seconds

    def pass_time(self, terms: BatchTerms) -> float:
        """One forward pass over ``terms`` without overhead or time_correction (a
        drafter's pass)."""
        streams, collective, _, _ = self._roof(terms.tokens, terms.seqs, terms.sums, terms.mla)
        return streams + collective

    def with_draft(self, cost: StepCost, draft: float) -> StepCost:
        """``cost`` with ``draft`` seconds of drafting added before time_correction."""
        if draft == 0.0:
            return cost
        roof = cost.roofline + draft
        return StepCost(self.alpha * roof + self.beta, roof, cost.compute, cost.memory)
