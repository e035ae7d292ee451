"""The price of a pure decode step from its window sums: the roofline's decode pricer.

A decode run (the engine's fast path) prices one step of the same rows after another,
each from nothing but its per-class attention sums; this is the function it calls,
made once per row count by :meth:`~inference_lab.core.roofline.Roofline.decode_pricer`
from that count's constants.

Rule 1: the function gives, to the bit, the floats ``Roofline._plain_price`` gives for
        ``BatchTerms(rows, rows, [[t, t] for t in sums])``: the same floating-point
        operations in the same order (a stream's ``max(compute, memory)`` is taken once,
        when it does not depend on the sums; a comparison is exact).
Rule 2: the common shapes (one or two window classes, at most one stream after
        attention's) have their loops unrolled: the function is called once per simulated
        step. (No stream after attention's is priced as one of 0.0 seconds: adding 0.0 to
        the non-negative times leaves their bits as they are.)
Rule 3: for the most common shape of all (two window classes, at most one stream after
        attention's) the decode runs' stretches do the pricer's arithmetic inline
        (:class:`TwoClasses`: its constants, the same operations in the same order), so
        a step there costs no call.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import attrs

__all__ = [
    "DecodeConstants",
    "DecodePricer",
    "DecodeStep",
    "TwoClasses",
    "decode_price_function",
    "decode_step",
]

#: per-class sums -> (seconds, roofline, compute, memory)
DecodePricer = Callable[[Sequence[int]], tuple[float, float, float, float]]


@attrs.frozen
class DecodeConstants:
    """What a pure decode step of a given row count costs before its sums: attention's
    flops and bytes owed to the rows (``fa0``, ``ma0``), per class the flops and bytes per
    unit of its sum (``coefs``), the recurrent state's bytes, attention's rate and the
    bandwidth, the streams before attention's summed (``compute0``, ``memory0``,
    ``roof0``), each stream after it (compute and memory seconds), the collectives and
    overhead (``tail``), the rows' per-sequence overhead (``seq``: ``[overheads]
    seq_overhead`` x rows, added last as ``_plain_price`` adds it), the time correction
    (``alpha``, ``beta``) and the efficiencies."""

    fa0: float
    ma0: float
    coefs: tuple[tuple[float, float], ...]
    state: float
    attn_rate: float
    bandwidth: float
    compute0: float
    memory0: float
    roof0: float
    after: tuple[tuple[float, float], ...]
    tail: float
    seq: float
    alpha: float
    beta: float
    eta_flops: float
    eta_bw: float


class TwoClasses(NamedTuple):
    """Rule 3: the constants of the two-class pricer (``_unrolled``'s ``price_two``), for
    a caller that does its arithmetic inline: with ``s0``, ``s1`` the two sums,
    ``tc = (fa0 + a0 * s0 + a1 * s1) / attn_rate``, ``tm = (ma0 + k0 * s0 + k1 * s1 +
    state) / bandwidth``, ``roof = roof0 + max(tc, tm) + most_after + tail + seq``, the
    seconds ``alpha * roof + beta``, the compute ``(compute0 + tc + c_after) * eta_flops``
    and the memory ``(memory0 + tm + m_after) * eta_bw``."""

    fa0: float
    ma0: float
    a0: float
    k0: float
    a1: float
    k1: float
    state: float
    attn_rate: float
    bandwidth: float
    roof0: float
    most_after: float
    tail: float
    seq: float
    alpha: float
    beta: float
    compute0: float
    c_after: float
    eta_flops: float
    memory0: float
    m_after: float
    eta_bw: float


class DecodeStep(NamedTuple):
    """A pure decode step's price for one row count: the pricer, and its constants when a
    caller may do its arithmetic inline (Rule 3; None otherwise)."""

    price: DecodePricer
    two: TwoClasses | None


def decode_step(k: DecodeConstants) -> DecodeStep:
    """The pricer of ``k`` and, for two classes and at most one stream after attention's,
    its constants for inline use (Rule 3). Called by the engine's decode runs."""
    two = None
    if len(k.after) <= 1 and len(k.coefs) == 2:
        ((c_after, m_after),) = k.after or ((0.0, 0.0),)
        (a0, k0), (a1, k1) = k.coefs  # (floats, as the pricer's products are)
        two = TwoClasses(
            k.fa0,
            k.ma0,
            float(a0),
            float(k0),
            float(a1),
            float(k1),
            k.state,
            k.attn_rate,
            k.bandwidth,
            k.roof0,
            c_after if c_after > m_after else m_after,
            k.tail,
            k.seq,
            k.alpha,
            k.beta,
            k.compute0,
            c_after,
            k.eta_flops,
            k.memory0,
            m_after,
            k.eta_bw,
        )
    return DecodeStep(decode_price_function(k), two)


def decode_price_function(k: DecodeConstants) -> DecodePricer:
    """The pricer for ``k`` (Rule 1), unrolled for the common shapes (Rule 2). Called by
    ``Roofline.decode_pricer``."""
    if len(k.after) <= 1 and len(k.coefs) in (1, 2):
        return _unrolled(k)
    return _general(k)


def _general(k: DecodeConstants) -> DecodePricer:
    """Any number of classes and streams: ``_plain_price``'s loops."""
    fa0, ma0, coefs, state = k.fa0, k.ma0, k.coefs, k.state
    attn_rate, bw, compute0, memory0, roof0 = (
        k.attn_rate,
        k.bandwidth,
        k.compute0,
        k.memory0,
        k.roof0,
    )
    after = [(tc, tm, tc if tc > tm else tm) for tc, tm in k.after]
    tail, seq, alpha, beta = k.tail, k.seq, k.alpha, k.beta
    eta_f, eta_b = k.eta_flops, k.eta_bw

    def decode_price(sums: Sequence[int]) -> tuple[float, float, float, float]:
        fa, ma = fa0, ma0
        for (attn_coef, kv_coef), total in zip(coefs, sums, strict=True):
            fa += attn_coef * float(total)
            ma += kv_coef * float(total)
        ma += state
        tc = fa / attn_rate
        tm = ma / bw
        compute = compute0 + tc
        memory = memory0 + tm
        roof = roof0 + (tc if tc > tm else tm)
        for tc, tm, most in after:
            compute += tc
            memory += tm
            roof += most
        roof += tail
        if seq:
            roof += seq
        return alpha * roof + beta, roof, compute * eta_f, memory * eta_b

    return decode_price


def _unrolled(k: DecodeConstants) -> DecodePricer:
    """One or two classes and at most one stream after attention's (Rule 2); none is
    one of nothing (adding ``0.0`` to a non-negative float leaves its bits)."""
    fa0, ma0, state = k.fa0, k.ma0, k.state
    attn_rate, bw, compute0, memory0, roof0 = (
        k.attn_rate,
        k.bandwidth,
        k.compute0,
        k.memory0,
        k.roof0,
    )
    ((c_after, m_after),) = k.after or ((0.0, 0.0),)
    most_after = c_after if c_after > m_after else m_after
    tail, seq, alpha, beta = k.tail, k.seq, k.alpha, k.beta
    eta_f, eta_b = k.eta_flops, k.eta_bw
    (a0, k0) = k.coefs[0]

    def price_one(sums: Sequence[int]) -> tuple[float, float, float, float]:
        s0 = float(sums[0])
        tc = (fa0 + a0 * s0) / attn_rate
        tm = (ma0 + k0 * s0 + state) / bw
        roof = roof0 + (tc if tc > tm else tm) + most_after + tail + seq
        return (
            alpha * roof + beta,
            roof,
            (compute0 + tc + c_after) * eta_f,
            (memory0 + tm + m_after) * eta_b,
        )

    if len(k.coefs) == 1:
        return price_one
    (a1, k1) = k.coefs[1]

    def price_two(sums: Sequence[int]) -> tuple[float, float, float, float]:
        s0 = float(sums[0])
        s1 = float(sums[1])
        tc = (fa0 + a0 * s0 + a1 * s1) / attn_rate
        tm = (ma0 + k0 * s0 + k1 * s1 + state) / bw
        roof = roof0 + (tc if tc > tm else tm) + most_after + tail + seq
        return (
            alpha * roof + beta,
            roof,
            (compute0 + tc + c_after) * eta_f,
            (memory0 + tm + m_after) * eta_b,
        )

    return price_two
