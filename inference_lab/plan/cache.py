"""The results cache: one file per finished job, named by the job's key.

Layout: ``<root>/<key[:2]>/<key>.npz`` (numpy's uncompressed archive: the per-request
latency arrays, the ITL percentiles and a JSON record of the counts, with a disaggregated
probe's P/D figures).

Rule 1: an entry is written whole or not at all: to a temporary file in the same
        directory, then renamed over the final name (``os.replace`` is atomic), so a plan
        interrupted at any instant (Ctrl-C, a kill) leaves only complete entries and
        temporary files that no reader opens (the next plan removes them).
Rule 2: only the planner's process writes, and only results (`ProbeResult`s, including
        the deterministic failures of jobs.py's Rule 3); a job whose worker died or that
        raised a bug is never cached.
Rule 3: an entry that cannot be read (foreign, truncated by a disk error) is a miss, never
        an error: the job runs again and its entry is replaced.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import attrs
import numpy as np

from inference_lab.plan.jobs import PdFigures, ProbeResult
from inference_lab.sim.summary import RequestLatencies

__all__ = ["ResultCache"]

_FORMAT = 2
_ARRAYS = ("ttft", "tpot", "e2e", "queue", "output_tokens")


class ResultCache:
    """A directory of `ProbeResult`s by job key (the module's Rules)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        self.removed_temporaries = 0
        for tmp in root.glob("*/.*.tmp"):
            tmp.unlink(missing_ok=True)
            self.removed_temporaries += 1

    def path(self, key: str) -> Path:
        return self.root / key[:2] / f"{key}.npz"

    def __contains__(self, key: str) -> bool:
        return self.path(key).is_file()

    def __len__(self) -> int:
        return sum(1 for _ in self.root.glob("*/*.npz"))

    def get(self, key: str) -> ProbeResult | None:
        """The cached result of `key`, or None (Rule 3)."""
        path = self.path(key)
        try:
            with np.load(path, allow_pickle=False) as data:
                meta = json.loads(str(data["meta"]))
                if meta.get("format") != _FORMAT or meta.get("key") != key:
                    return None
                arrays = {name: np.array(data[name]) for name in _ARRAYS}
                itl = np.array(data["itl"])
            pd = None if meta.get("pd") is None else PdFigures(**meta["pd"])
        except (OSError, ValueError, KeyError, TypeError):
            return None
        return ProbeResult(
            key=key,
            rate=meta["rate"],
            requests=meta["requests"],
            completed=meta["completed"],
            refused=meta["refused"],
            refusal=meta["refusal"],
            error=meta["error"],
            span_s=meta["span_s"],
            latencies=RequestLatencies(**arrays),
            itl=itl,
            wall_s=meta["wall_s"],
            worker=meta["worker"],
            pd=pd,
        )

    def put(self, result: ProbeResult) -> None:
        """Store `result` under its key (Rule 1)."""
        path = self.path(result.key)
        path.parent.mkdir(exist_ok=True)
        meta = {
            "format": _FORMAT,
            "key": result.key,
            "rate": result.rate,
            "requests": result.requests,
            "completed": result.completed,
            "refused": result.refused,
            "refusal": result.refusal,
            "error": result.error,
            "span_s": result.span_s,
            "wall_s": result.wall_s,
            "worker": result.worker,
            "pd": None if result.pd is None else attrs.asdict(result.pd),
        }
        arrays = {name: getattr(result.latencies, name) for name in _ARRAYS}
        tmp = path.parent / f".{result.key}.{os.getpid()}.tmp"
        try:
            with open(tmp, "wb") as fh:
                np.savez(fh, meta=np.array(json.dumps(meta)), itl=result.itl, **arrays)
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
