"""Measured step tables: a CSV of step times that prices steps in place of the roofline.

A hardware entry's ``step_table`` names a CSV whose rows are measured engine steps
(docs/fidelity.md#measured-step-tables has the user's view):

``batch_size``      sequences in the step (int >= 1);
``prefill_tokens``  tokens the step computes beyond one per sequence: the step's new
                    tokens minus ``batch_size`` (int >= 0; 0 for a step in which every
                    sequence decodes one token; one sequence prefilling a chunk of ``n``
                    tokens adds ``n - 1``);
``context_tokens``  the mean, over the step's sequences, of the positions each attends at
                    its chunk's midpoint, ``c + ceil(n / 2)`` for a sequence computing
                    ``n`` new positions on top of ``c`` (number >= 0; a decode step at
                    context ``c`` is ``c + 1``), as the roofline prices attention;
``step_seconds``    the measured duration of the step (number > 0).

Rule 1: the points form a full grid: every combination of the distinct values of the
        three coordinates has exactly one row (a missing or duplicated point is an error
        naming it), so the interpolation below is defined everywhere inside the box the
        axes span.
Rule 2: inside the box a step's time is the multilinear interpolation of the measured
        times (linear in each coordinate between the two nearest axis values; an axis
        with one value is matched by that value); at a grid point it is the measured time
        exactly.
Rule 3: outside the box the step is priced at the nearest point of the box (each
        coordinate clamped to its axis) and scaled by the step model's ratio between the
        step and that point (``Roofline`` does the scaling; this module only clamps and
        interpolates).
Rule 4: parsing is pure (text in, :class:`StepTable` out); the config loader reads the
        file. Every error is a ConfigError naming the file and line.
"""

from __future__ import annotations

import bisect
import math

import attrs

from inference_lab.errors import ConfigError

__all__ = ["COLUMNS", "StepTable", "parse_step_rows", "parse_step_table"]

#: The CSV's columns (a header line names them, in any order).
COLUMNS = ("batch_size", "prefill_tokens", "context_tokens", "step_seconds")


@attrs.frozen
class StepTable:
    """A full grid of measured step times (Rule 1). ``seconds`` is the grid flattened
    with ``batch`` outermost and ``context`` innermost."""

    source: str
    batch: tuple[float, ...]
    prefill: tuple[float, ...]
    context: tuple[float, ...]
    seconds: tuple[float, ...]

    def clamp(self, b: float, p: float, c: float) -> tuple[float, float, float]:
        """The nearest point of the table's box to ``(b, p, c)`` (Rule 3)."""
        return (
            min(max(b, self.batch[0]), self.batch[-1]),
            min(max(p, self.prefill[0]), self.prefill[-1]),
            min(max(c, self.context[0]), self.context[-1]),
        )

    def interpolate(self, b: float, p: float, c: float) -> float:
        """The multilinear interpolation at ``(b, p, c)``, a point inside the box
        (Rule 2; callers clamp first)."""
        ib, wb = _bracket(self.batch, b)
        ip, wp = _bracket(self.prefill, p)
        ic, wc = _bracket(self.context, c)
        n_p, n_c = len(self.prefill), len(self.context)
        total = 0.0
        for db, fb in ((0, 1.0 - wb), (1, wb)):
            if fb == 0.0:
                continue
            for dp, fp in ((0, 1.0 - wp), (1, wp)):
                if fp == 0.0:
                    continue
                for dc, fc in ((0, 1.0 - wc), (1, wc)):
                    if fc == 0.0:
                        continue
                    index = ((ib + db) * n_p + (ip + dp)) * n_c + (ic + dc)
                    total += fb * fp * fc * self.seconds[index]
        return total


def _bracket(axis: tuple[float, ...], x: float) -> tuple[int, float]:
    """``(i, w)``: ``x`` lies between ``axis[i]`` and ``axis[i + 1]`` at weight ``w`` of
    the way (``w == 0`` at ``axis[i]``; an axis of one value gives ``(0, 0.0)``)."""
    if len(axis) == 1 or x <= axis[0]:
        return 0, 0.0
    if x >= axis[-1]:
        return len(axis) - 2, 1.0
    i = bisect.bisect_right(axis, x) - 1
    lo, hi = axis[i], axis[i + 1]
    return i, (x - lo) / (hi - lo)


def _number(cell: str, where: str, column: str, *, integer: bool, lowest: float) -> float:
    try:
        value = int(cell) if integer else float(cell)
    except ValueError:
        kind = "an integer" if integer else "a number"
        raise ConfigError(f"{where}: {column}: must be {kind}, got {cell!r}") from None
    if not math.isfinite(value) or value < lowest or (column == "step_seconds" and value <= 0):
        bound = "> 0" if column == "step_seconds" else f">= {lowest:g}"
        raise ConfigError(f"{where}: {column}: must be {bound}, got {cell!r}")
    return float(value)


def parse_step_rows(text: str, source: str) -> list[tuple[float, float, float, float, int]]:
    """The rows of a step CSV as ``(batch_size, prefill_tokens, context_tokens,
    step_seconds, line)``, in file order, each checked (no grid required: ``calibrate``
    reads any set of measured steps). Blank lines and lines starting with ``#`` are
    skipped; the first other line is the header, naming the columns in any order."""
    header: list[str] | None = None
    rows: list[tuple[float, float, float, float, int]] = []
    for number, line in enumerate(text.splitlines(), start=1):
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        cells = [c.strip() for c in stripped.split(",")]
        where = f"{source}:{number}"
        if header is None:
            missing = [c for c in COLUMNS if c not in cells]
            extra = [c for c in cells if c not in COLUMNS]
            if missing or extra or len(cells) != len(COLUMNS):
                raise ConfigError(
                    f"{where}: the header must name the columns {', '.join(COLUMNS)}; got "
                    f"{stripped!r}"
                )
            header = cells
            continue
        if len(cells) != len(header):
            raise ConfigError(f"{where}: expected {len(header)} cells, got {len(cells)}")
        row = dict(zip(header, cells, strict=True))
        b = _number(row["batch_size"], where, "batch_size", integer=True, lowest=1)
        p = _number(row["prefill_tokens"], where, "prefill_tokens", integer=True, lowest=0)
        c = _number(row["context_tokens"], where, "context_tokens", integer=False, lowest=0)
        s = _number(row["step_seconds"], where, "step_seconds", integer=False, lowest=0)
        rows.append((b, p, c, s, number))
    if header is None:
        raise ConfigError(f"{source}: empty step table (a header naming {', '.join(COLUMNS)})")
    if not rows:
        raise ConfigError(f"{source}: no rows after the header")
    return rows


def parse_step_table(text: str, source: str) -> StepTable:
    """Parse a step table's CSV text (``source`` names it in errors): the rows of
    :func:`parse_step_rows`, which must form a full grid (Rule 1)."""
    points: dict[tuple[float, float, float], tuple[float, int]] = {}
    for b, p, c, s, number in parse_step_rows(text, source):
        key = (b, p, c)
        if key in points:
            raise ConfigError(
                f"{source}:{number}: batch_size {b:g}, prefill_tokens {p:g}, context_tokens "
                f"{c:g} is already on line {points[key][1]}"
            )
        points[key] = (s, number)
    batch = tuple(sorted({k[0] for k in points}))
    prefill = tuple(sorted({k[1] for k in points}))
    context = tuple(sorted({k[2] for k in points}))
    seconds = []
    for b in batch:
        for p in prefill:
            for c in context:
                hit = points.get((b, p, c))
                if hit is None:
                    raise ConfigError(
                        f"{source}: not a full grid: no row for batch_size {b:g}, "
                        f"prefill_tokens {p:g}, context_tokens {c:g} (every combination of "
                        "the three columns' values needs one)"
                    )
                seconds.append(hit[0])
    return StepTable(
        source=source, batch=batch, prefill=prefill, context=context, seconds=tuple(seconds)
    )
