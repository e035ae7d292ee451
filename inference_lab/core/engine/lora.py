"""LoRA adapters in the engine: the adapters served, each worker's GPU slots, the batch's
adapter limit, the price of loading an adapter and of its kernels.

Modelled on vLLM v1: ``LoRAConfig`` (``max_loras``, ``max_lora_rank``,
``max_cpu_loras``), the scheduler's ``scheduled_loras`` check, the LRU adapter managers of
``vllm/lora/worker_manager.py`` and the punica shrink/expand kernels.

Rule 1: a batch holds requests of at most ``max_loras`` distinct adapters. A waiting
        request whose adapter is not among the running requests' and would make one more
        than ``max_loras`` is skipped: it keeps its place in the queue, and the requests
        behind it may be admitted (vLLM's ``skipped_waiting_requests``, put back in
        order). A request of the base model is never skipped.
Rule 2: each worker has ``max_loras`` GPU slots, least recently used first. At a step's
        start an adapter of the batch not in a slot is loaded into the least recently used
        slot no member of the batch uses; each load takes ``latency + bytes / (bandwidth x
        tp)`` over the profile's ``[host]`` link, one after another, before the step's
        kernels (vLLM activates adapters before the forward pass). ``bytes`` = ``rank x
        adapter_widths x 2`` (bf16 weights). A host cache of ``max_cpu_loras`` adapters
        (LRU) is kept beside: a load of an adapter it had evicted counts as cold (its file
        read again; the disk is not priced).
Rule 3: a step's adapter kernels add, serially after its roofline time, ``max(FLOPs /
        rate, bytes / bandwidth)`` x ``alpha``: ``FLOPs = 2 x T_a x R x W`` (the shrink
        ``[T, in] x [in, R]`` and the expand ``[T, R] x [R, out]`` on every adapted
        projection) and ``bytes = A x R x W x 2`` (each of the batch's ``A`` adapters' A
        and B read once), with ``T_a`` the step's tokens of adapter requests, ``W`` =
        ``adapter_widths`` and ``R`` = ``max_lora_rank``: vLLM's slots are padded to it.
        ``rate`` is the bf16 rate of the replica's GPUs at the deployment's efficiency.
Rule 4: a request of an adapter carries its own block hashes: each of its chain's hashes
        is hashed again with the adapter's name (vLLM's extra keys), so no prefix is ever
        shared between two adapters or with the base model.
Rule 5: a late arrival (engine Rule 2) joins the step in flight when Rule 1 admits it
        there (a base-model request, or an adapter that keeps the running requests within
        ``max_loras``), as if it had been in the batch from the step's start: its
        adapter is loaded then if it is not in a slot, and the step is priced again (its
        loads and its kernels over the batch it joined).
Rule 6: a deployment without ``[lora]`` builds nothing here and pays nothing.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import Protocol

import attrs

from inference_lab.core.config import Deployment, LoraConfig, adapter_widths
from inference_lab.core.engine.outputs import LoraStatistics
from inference_lab.core.engine.request import Request
from inference_lab.core.engine.wait_queue import WaitQueue
from inference_lab.core.roofline import StepCost
from inference_lab.traffic.hashing import block_hash

__all__ = ["Adapter", "AdapterSet", "Admitting", "LoraSlots", "adapter_hashes"]

#: bytes per adapter weight (vLLM's ``lora_dtype`` "auto": the model's bf16)
LORA_BYTES = 2


@attrs.frozen
class Adapter:
    """An adapter the engine serves: its id (vLLM's ``lora_int_id``, from 1), name, path,
    rank and the base model it adapts (None: the served model)."""

    id: int
    name: str
    path: str
    rank: int
    parent: str | None = None


def adapter_hashes(hashes: tuple[int, ...], name: str) -> tuple[int, ...]:
    """Rule 4: ``hashes`` (a request's chain) as the adapter ``name`` sees them."""
    key = b"lora:" + name.encode()
    return tuple(block_hash(h & 0xFFFFFFFFFFFFFFFF, key) for h in hashes)


class Admitting(Protocol):
    """What :meth:`LoraSlots.admit` uses of a scheduler."""

    running: list[Request]
    waiting: WaitQueue

    def admit_head(self, now: float, mark: int, budget: int) -> tuple[Request, int] | None: ...


class AdapterSet:
    """The adapters one engine serves, by name and id. Called by the engine (``submit``
    resolves a request's adapter; ``load_adapter`` / ``unload_adapter``)."""

    def __init__(self, config: LoraConfig) -> None:
        self.config = config
        self.by_name: dict[str, Adapter] = {}
        #: every adapter ever added (an unloaded one stays for the requests that use it)
        self.by_id: dict[int, Adapter] = {}
        #: the adapters unloaded, by name (the last of each name)
        self.retired: dict[str, Adapter] = {}
        self._ids = itertools.count(1)
        for a in config.adapters:
            self.add(a.name, a.path or a.name, config.rank_of(a), a.base_model_name)

    def add(self, name: str, path: str, rank: int, parent: str | None = None) -> Adapter:
        """A new adapter (rank 0: ``max_lora_rank``). ValueError when the name is served
        already or the rank is outside ``1..max_lora_rank``."""
        if name in self.by_name:
            raise ValueError(f"The lora adapter '{name}' has already been loaded.")
        rank = rank or self.config.max_lora_rank
        if not 1 <= rank <= self.config.max_lora_rank:
            raise ValueError(
                f"LoRA rank {rank} is greater than max_lora_rank {self.config.max_lora_rank}."
            )
        adapter = Adapter(next(self._ids), name, path, rank, parent)
        self.by_name[name] = adapter
        self.by_id[adapter.id] = adapter
        return adapter

    def remove(self, name: str) -> Adapter:
        """Stop serving ``name`` (KeyError when it is not served). Requests already
        submitted with it run on: its id stays known, and its name in ``retired``."""
        adapter = self.by_name.pop(name)
        self.retired[name] = adapter
        return adapter

    def resolve(self, name: str) -> Adapter | None:
        """The adapter a request naming ``name`` runs with: the one served, else the last
        one unloaded (a request admitted before the unload reaches the engine after it)."""
        return self.by_name.get(name) or self.retired.get(name)


class LoraSlots:
    """One worker's GPU slots and host cache, its admission rule and its prices (Rules 1
    to 3). Built by its scheduler when the deployment has ``[lora]``."""

    def __init__(self, dep: Deployment, adapters: AdapterSet, bandwidth: float) -> None:
        lora = dep.lora
        host = dep.profile.host
        assert lora is not None and host is not None  # with_lora checks both
        tp = dep.hardware.tp
        eff = dep.efficiency
        self.adapters = adapters
        self.max_loras = lora.max_loras
        self.cpu_slots = lora.cpu_slots
        self.widths = adapter_widths(dep.model, lora.mlp_dim)
        self.rank = lora.max_lora_rank
        self.host_bandwidth = host.bandwidth * tp
        self.host_latency = host.latency
        rate = dep.profile.flops("bf16")
        self.rate = (rate if rate is not None else dep.profile.flops("fp16") or 1.0) * tp
        self.rate *= eff.flops
        self.bandwidth = bandwidth
        self.alpha = dep.hardware.time_correction.alpha
        self.gpu: OrderedDict[int, None] = OrderedDict()
        self.cpu: OrderedDict[int, None] = OrderedDict((a, None) for a in adapters.by_id)
        while len(self.cpu) > self.cpu_slots:
            self.cpu.popitem(last=False)
        self.loads = 0
        self.cold_loads = 0
        self.load_seconds = 0.0
        self.skips = 0
        #: seconds the step in flight spent loading adapters at its start (Rule 2)
        self.load_now = 0.0

    def load_bytes(self, rank: int) -> int:
        """Bytes of a rank-``rank`` adapter (Rule 2)."""
        return rank * self.widths * LORA_BYTES

    def added(self, adapter: Adapter) -> None:
        """A new adapter was loaded into host memory (vLLM's ``add_lora`` pre-loads it)."""
        self._touch_cpu(adapter.id)

    def _touch_cpu(self, a: int) -> bool:
        """``a`` is used in host memory: True when it was there already."""
        cpu = self.cpu
        warm = a in cpu
        cpu[a] = None
        cpu.move_to_end(a)
        while len(cpu) > self.cpu_slots:
            cpu.popitem(last=False)
        return warm

    # ------------------------------------------------------------------ Rule 1
    def admit(
        self,
        w: Admitting,
        now: float,
        mark: int,
        budget: int,
        batch: list[tuple[Request, int]],
        ns: list[int],
        cs: list[int],
    ) -> int:
        """The scheduler's admissions from the waiting queue under Rule 1: as its own loop
        (the head by policy while the cap, the budget and the blocks allow), skipping a
        head whose adapter would make one too many. Appends to ``batch``, ``ns`` and
        ``cs``; returns the budget left. Called by ``Scheduler.schedule``."""
        loras = {r.lora for r in w.running if r.lora}
        waiting = w.waiting
        skipped: list[tuple[Request, bool]] = []
        while budget > 0 and waiting.count:
            head = waiting.peek()
            assert head is not None
            a = head.lora
            if a and a not in loras and len(loras) >= self.max_loras:
                skipped.append(waiting.pop_head())
                self.skips += 1
                continue
            admitted = w.admit_head(now, mark, budget)
            if admitted is None:
                break
            r, n = admitted
            batch.append((r, n))
            ns.append(n)
            cs.append(r.num_computed)
            budget -= n
            if a:
                loras.add(a)
        if skipped:
            waiting.restore(skipped)
        return budget

    def may_join(self, r: Request, running: Sequence[Request]) -> bool:
        """Whether ``r`` may join the step in flight late (engine Rule 2): a base-model
        request, or one whose adapter keeps the running requests within ``max_loras``
        (Rule 1). The step is then priced again (:meth:`again`), with its adapter's load if
        it is not in a slot (Rule 5)."""
        a = r.lora
        if not a:
            return True
        loras = {x.lora for x in running if x.lora}
        return a in loras or len(loras) < self.max_loras

    # ------------------------------------------------------------------ Rules 2 and 3
    def price(self, cost: StepCost, batch: Iterable[tuple[Request, int]]) -> StepCost:
        """The price of a step starting now with ``batch``: ``cost`` (its roofline price)
        plus its adapter loads (Rule 2: the slots change now) and kernels (Rule 3)."""
        ids, tokens = _adapter_terms(batch)
        self.load_now = self._load(ids) if ids else 0.0
        return self._with_kernels(cost, ids, tokens)

    def again(self, cost: StepCost, batch: Iterable[tuple[Request, int]]) -> StepCost:
        """The step in flight priced again with ``batch`` (a late arrival joined it): its
        new roofline price, its loads (those made at its start, and the late member's
        adapter's if it was not in a slot: Rule 5) and its kernels over ``batch``."""
        ids, tokens = _adapter_terms(batch)
        if ids:
            self.load_now += self._load(ids)
        return self._with_kernels(cost, ids, tokens)

    def _with_kernels(self, cost: StepCost, ids: dict[int, None], tokens: int) -> StepCost:
        if not ids:
            return cost
        flops = 2.0 * tokens * self.rank * self.widths
        nbytes = float(len(ids) * self.rank * self.widths * LORA_BYTES)
        kernels = max(flops / self.rate, nbytes / self.bandwidth)
        return StepCost(
            seconds=cost.seconds + self.alpha * kernels + self.load_now,
            roofline=cost.roofline + kernels,
            compute=cost.compute,
            memory=cost.memory,
        )

    def _load(self, ids: dict[int, None]) -> float:
        """Rule 2: the batch's adapters ``ids`` into the GPU slots; the seconds it takes."""
        gpu = self.gpu
        seconds = 0.0
        for a in ids:
            if a in gpu:
                gpu.move_to_end(a)
                continue
            if len(gpu) >= self.max_loras:
                for old in gpu:
                    if old not in ids:
                        del gpu[old]
                        break
            gpu[a] = None
            if not self._touch_cpu(a):
                self.cold_loads += 1
            rank = self.adapters.by_id[a].rank
            t = self.host_latency + self.load_bytes(rank) / self.host_bandwidth
            seconds += t
            self.loads += 1
            self.load_seconds += t
        return seconds

    def statistics(self, running: Sequence[Request], waiting: Iterable[Request]) -> LoraStatistics:
        by_id = self.adapters.by_id
        return LoraStatistics(
            loads=self.loads,
            cold_loads=self.cold_loads,
            load_seconds=self.load_seconds,
            skips=self.skips,
            resident=tuple(by_id[a].name for a in self.gpu),
            running=_names(by_id, running),
            waiting=_names(by_id, waiting),
        )


def _adapter_terms(batch: Iterable[tuple[Request, int]]) -> tuple[dict[int, None], int]:
    """The distinct adapters of ``batch`` (in batch order) and its adapter tokens."""
    ids: dict[int, None] = {}
    tokens = 0
    for r, n in batch:
        a = r.lora
        if a:
            ids[a] = None
            tokens += n * (r.n if r.n > 1 and r.num_computed >= r.prompt_tokens else 1)
    return ids, tokens


def _names(by_id: dict[int, Adapter], requests: Iterable[Request]) -> tuple[str, ...]:
    """The distinct adapters of ``requests``, by name, in the order first seen."""
    seen: dict[int, None] = {}
    for r in requests:
        if r.lora:
            seen[r.lora] = None
    return tuple(by_id[a].name for a in seen)
