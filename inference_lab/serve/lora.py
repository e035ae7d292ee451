"""LoRA adapters as vLLM serves them: ``--enable-lora`` and its flags, the adapters a
request's ``model`` may name, ``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter``,
and ``vllm:lora_requests_info`` (docs/lora.md).

Rule 1: the flags are vLLM's: ``--enable-lora``, ``--lora-modules`` (``name=path`` or a
        JSON object with ``name``, ``path``, ``base_model_name``, and here ``rank``; several
        separated by spaces), ``--max-loras`` (1), ``--max-lora-rank`` (16),
        ``--max-cpu-loras`` (``--max-loras``). A model config's ``[lora]`` turns LoRA on
        without the flag; the flags then override its values. A bad spec is a one-line
        error naming the flag.
Rule 2: the runtime routes (serve/lora_routes.py) exist only when ``VLLM_ALLOW_RUNTIME_LORA_UPDATING`` is ``1``
        or ``true`` (vLLM's gate): without it they answer 404 as any unknown path does.
        Their answers are vLLM's: the success sentence as plain text, 400 for a missing
        field or a name loaded already, 404 for unloading a name not loaded. Loading past
        ``max_cpu_loras`` succeeds (the host cache drops its least recently used adapter,
        as vLLM's LRU cache does); unloading an adapter in use succeeds (its running
        requests finish with it).
Rule 3: a request naming an adapter runs on the adapter's base model with it; a name
        neither a model nor an adapter is the app's 404 ``model_not_found``.
Rule 4: ``vllm:lora_requests_info`` is a gauge whose labels are ``max_lora``,
        ``waiting_lora_adapters`` and ``running_lora_adapters`` (the adapters' names,
        comma-separated) and whose value is the scrape's wall-clock time, one series per
        model with adapters (vLLM has no ``model_name`` label on it).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import attrs
from prometheus_client.core import GaugeMetricFamily, Metric

from inference_lab.core.config import LORA_RANKS, Deployment, LoraAdapter, LoraConfig, with_lora
from inference_lab.errors import ConfigError
from inference_lab.runtime.model_runtime import ModelRuntime
from inference_lab.validation import FieldError

__all__ = [
    "RUNTIME_UPDATING_ENV",
    "model_cards",
    "LoraFlags",
    "add_lora_flags",
    "apply_lora",
    "lora_flags",
    "lora_info_family",
    "parse_lora_module",
    "runtime_updating",
]

#: vLLM's gate on the runtime routes (Rule 2)
RUNTIME_UPDATING_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"


@attrs.frozen(kw_only=True)
class LoraFlags:
    """What the LoRA flags said (None: not given)."""

    enable: bool = False
    modules: tuple[LoraAdapter, ...] = ()
    max_loras: int | None = None
    max_lora_rank: int | None = None
    max_cpu_loras: int | None = None


def add_lora_flags(parser: argparse.ArgumentParser) -> None:
    """Rule 1: vLLM's LoRA flags, in their own group."""
    from inference_lab.cli_args import integer

    group = parser.add_argument_group("LoRA adapters (vLLM's flags; docs/lora.md)")
    group.add_argument("--enable-lora", action="store_true", help="serve LoRA adapters")
    group.add_argument(
        "--lora-modules",
        nargs="+",
        action="extend",
        metavar="SPEC",
        help="adapters served from the start: name=path, or a JSON object with name, path, "
        "base_model_name and rank (the path is only a name here)",
    )
    group.add_argument(
        "--max-loras", type=integer(ge=1), help="adapters in one batch (GPU slots; default 1)"
    )
    group.add_argument(
        "--max-lora-rank",
        type=int,
        help=f"the largest rank, one of {', '.join(map(str, LORA_RANKS))} (default 16)",
    )
    group.add_argument(
        "--max-cpu-loras", type=integer(ge=1), help="adapters kept in host memory (--max-loras)"
    )


def parse_lora_module(item: str) -> LoraAdapter:
    """One ``--lora-modules`` item (Rule 1); ConfigError naming it otherwise."""
    if "=" in item and "," not in item and not item.lstrip().startswith("{"):
        name, _, path = item.partition("=")
        if not name or not path or "=" in path:
            raise ConfigError(f"--lora-modules: invalid format {item!r} (expected name=path)")
        return LoraAdapter(name=name, path=path)
    try:
        raw = json.loads(item)
    except json.JSONDecodeError:
        raise ConfigError(
            f"--lora-modules: invalid JSON format {item!r} (expected name=path or a JSON object)"
        ) from None
    fields = {"name", "path", "base_model_name", "rank"}
    if not isinstance(raw, dict) or not {"name", "path"} <= set(raw) or set(raw) - fields:
        raise ConfigError(
            f"--lora-modules: invalid fields {item!r} (name and path required; "
            "base_model_name and rank allowed)"
        )
    name, path, base, rank = raw["name"], raw["path"], raw.get("base_model_name"), raw.get("rank")
    if not (isinstance(name, str) and name and isinstance(path, str) and path):
        raise ConfigError(f"--lora-modules: {item!r}: name and path must be non-empty strings")
    if base is not None and not isinstance(base, str):
        raise ConfigError(f"--lora-modules: {item!r}: base_model_name must be a string")
    if rank is not None and (type(rank) is not int or rank < 1):
        raise ConfigError(f"--lora-modules: {item!r}: rank must be an integer >= 1")
    return LoraAdapter(name=name, path=path, rank=rank or 0, base_model_name=base)


def lora_flags(args: argparse.Namespace) -> LoraFlags | None:
    """The LoRA flags of ``serve``'s command line (None: none given). ConfigError, one line,
    for a bad module spec or a flag given without ``--enable-lora``."""
    enable = bool(getattr(args, "enable_lora", False))
    values = {
        "--lora-modules": getattr(args, "lora_modules", None),
        "--max-loras": getattr(args, "max_loras", None),
        "--max-lora-rank": getattr(args, "max_lora_rank", None),
        "--max-cpu-loras": getattr(args, "max_cpu_loras", None),
    }
    if not enable:
        for flag, value in values.items():
            if value is not None:
                raise ConfigError(f"{flag}: needs --enable-lora")
        return None
    modules = tuple(parse_lora_module(item) for item in values["--lora-modules"] or ())
    return LoraFlags(
        enable=True,
        modules=modules,
        max_loras=values["--max-loras"],
        max_lora_rank=values["--max-lora-rank"],
        max_cpu_loras=values["--max-cpu-loras"],
    )


def apply_lora(deployments: Sequence[Deployment], flags: LoraFlags | None) -> list[Deployment]:
    """Each deployment with its LoRA configuration (Rule 1): a config's ``[lora]`` with the
    flags over it; ``--enable-lora`` gives every model one. A module goes to the model its
    ``base_model_name`` names, else to the first. ConfigError, one line."""
    if flags is None:
        return list(deployments)
    names = [d.model.name for d in deployments]
    for m in flags.modules:
        if m.base_model_name is not None and m.base_model_name not in names:
            raise ConfigError(
                f"--lora-modules: {m.name}: base_model_name {m.base_model_name!r} is not a "
                f"served model ({', '.join(names)})"
            )
    out = []
    for i, dep in enumerate(deployments):
        base = dep.lora or LoraConfig()
        mine = tuple(
            m
            for m in flags.modules
            if m.base_model_name == dep.model.name or (m.base_model_name is None and i == 0)
        )
        changes: dict[str, Any] = {"adapters": base.adapters + mine}
        for key in ("max_loras", "max_lora_rank", "max_cpu_loras"):
            value = getattr(flags, key)
            if value is not None:
                changes[key] = value
        try:
            lora = attrs.evolve(base, **changes)
        except FieldError as exc:  # (the config class's own check)
            key = exc.field.split(".")[0]
            flag = "--lora-modules" if key == "adapters" else "--" + key.replace("_", "-")
            raise ConfigError(f"{flag}: {exc}") from None
        out.append(with_lora(dep, lora, f"{dep.config_path}: --enable-lora"))
    return out


def runtime_updating(environ: dict[str, str] | None = None) -> bool:
    """Rule 2: whether the runtime routes are on (vLLM's test of the variable)."""
    env = os.environ if environ is None else environ
    return env.get(RUNTIME_UPDATING_ENV, "0").strip().lower() in ("1", "true")


def model_cards(runtime: ModelRuntime, created: int) -> list[dict[str, Any]]:
    """The ``/v1/models`` cards of ``runtime``'s adapters, as vLLM writes them: ``root``
    the adapter's path, ``parent`` its base model."""
    adapters = runtime.engine.adapters
    if adapters is None:
        return []
    return [
        {
            "id": a.name,
            "object": "model",
            "created": created,
            "owned_by": "inference-lab",
            "root": a.path,
            "parent": a.parent or runtime.name,
            "max_model_len": None,
        }
        for a in adapters.by_name.values()
    ]


def lora_info_family(runtimes: Iterable[ModelRuntime]) -> Iterator[Metric]:
    """Rule 4: ``vllm:lora_requests_info`` for the models that serve adapters."""
    family = GaugeMetricFamily(
        "vllm:lora_requests_info",
        "Running stats on lora requests.",
        labels=["max_lora", "waiting_lora_adapters", "running_lora_adapters"],
    )
    any_lora = False
    now = time.time()
    for rt in runtimes:
        lora = rt.deployment.lora
        if lora is None:
            continue
        any_lora = True
        running: dict[str, None] = {}
        waiting: dict[str, None] = {}
        for w in rt.engine.statistics().workers:
            if w.lora is not None:
                running.update(dict.fromkeys(w.lora.running))
                waiting.update(dict.fromkeys(w.lora.waiting))
        family.add_metric([str(lora.max_loras), ",".join(waiting), ",".join(running)], now)
    if any_lora:
        yield family
