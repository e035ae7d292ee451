"""`inference_lab.core.builders`: the positional constructors give the objects `__init__`
gives, and refuse a class whose `__init__` does more than set its slots."""

from __future__ import annotations

import attrs
import pytest

from inference_lab.core.builders import frozen_builder
from inference_lab.core.engine import Finished, RequestSpec, StepEvents, StepInfo
from inference_lab.core.roofline import StepCost


def _values(cls: type) -> dict[str, object]:
    """A distinct value per field (so that a swapped pair would show)."""
    out: dict[str, object] = {}
    for i, f in enumerate(attrs.fields(cls)):
        if f.type in ("int", int):
            out[f.name] = 100 + i
        elif f.type in ("float", float):
            out[f.name] = i + 0.25
        elif f.type in ("str", str):
            out[f.name] = f"s{i}"
        else:
            out[f.name] = (i,)
    return out


@pytest.mark.parametrize("cls", [StepEvents, StepInfo, Finished, StepCost, RequestSpec], ids=str)
def test_a_built_record_is_the_one_init_gives(cls: type) -> None:
    values = _values(cls)
    build = frozen_builder(cls)
    by_init = cls(**values)
    assert build(*values.values()) == by_init  # positional, in field order
    assert build(**values) == by_init
    got = build(**values)
    for name, value in values.items():
        assert getattr(got, name) is value
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        got.__setattr__(next(iter(values)), 0)


def test_left_out_fields_take_their_defaults() -> None:
    info = frozen_builder(StepInfo)(0, 1.5, 0.25, 3, 4, 0.5, 0.125, 0.75, 2)
    assert info == StepInfo(
        worker=0,
        start=1.5,
        duration=0.25,
        num_seqs=3,
        num_tokens=4,
        kv_usage=0.5,
        flop_util=0.125,
        bw_util=0.75,
        preempted=2,
    )


@attrs.frozen
class _Checked:
    x: int = attrs.field(validator=attrs.validators.instance_of(int))


@attrs.frozen
class _Listed:
    x: list[int] = attrs.field(factory=list)


@attrs.frozen
class _Posted:
    x: int

    def __attrs_post_init__(self) -> None:
        pass


@pytest.mark.parametrize("cls", [_Checked, _Listed, _Posted], ids=str)
def test_a_class_whose_init_does_more_is_refused(cls: type) -> None:
    with pytest.raises(TypeError):
        frozen_builder(cls)
