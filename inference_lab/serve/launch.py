"""A plain hypercorn launch that cannot start: one line on stderr and a non-zero exit.

``hypercorn --worker-class trio 'inference_lab.serve:create_app()'`` builds the app from the
``INFERENCE_LAB_*`` variables in hypercorn's worker process, when the worker loads the
application; a bad variable or a missing config is a ``ConfigError`` there.

Rule 1: the message is one line, ``inference-lab: error: <message>``, and no traceback.
Rule 2: the process the supervisor (systemd, a container runtime, a shell script) started
        exits non-zero. With ``--workers 0`` hypercorn runs the worker in that process, and
        ``SystemExit(1)`` leaves hypercorn's ``main`` as exit code 1. With workers
        (hypercorn's default is one) that process is hypercorn's supervising parent, and
        hypercorn 0.18 lets it exit 0 whatever its worker's code: ``hypercorn.run.run``
        records the failed worker's code, then replaces it with the 0 of a second
        ``_join_exited`` over the now empty process list (upstream issue #269, fix
        proposed in #372). The worker therefore ends that parent with SIGKILL, so the
        supervisor sees a failure (a shell: status 137) -- only when this process was
        started by hypercorn's supervisor (its ``multiprocessing`` target is a hypercorn
        worker function) and that supervisor is still its parent.
Rule 3: before that, the worker unlinks the supervisor's ``multiprocessing`` semaphores (its
        shutdown event, which hypercorn hands every worker) and unregisters them from the
        resource tracker: a killed supervisor cannot, and the tracker would otherwise
        report them leaked on stderr after the one line. Only the worker whose unlink
        succeeds unregisters a name, so several failing workers do not unregister twice.
Rule 4: a parent that is PID 1 of its namespace (hypercorn as a container's init, without
        ``--init``) ignores signals it has no handler for, SIGKILL included; there only
        ``--workers 0`` makes the failure visible (``docs/serve.md`` says so).
"""

from __future__ import annotations

import contextlib
import multiprocessing
import multiprocessing.synchronize as mp_sync
import os
import signal
import sys
from collections.abc import Iterator
from multiprocessing import resource_tracker
from typing import Any, NoReturn

__all__ = ["fail_launch", "hypercorn_supervisor"]


def hypercorn_supervisor() -> int | None:
    """The pid of the hypercorn supervisor that started this process as one of its
    workers and is still its parent, else None (a ``--workers 0`` launch, a test, any
    other parent)."""
    parent = multiprocessing.parent_process()
    if parent is None or parent.pid is None:
        return None
    target = getattr(multiprocessing.current_process(), "_target", None)
    if not getattr(target, "__module__", "").startswith("hypercorn."):
        return None
    return parent.pid if os.getppid() == parent.pid else None


def fail_launch(message: str) -> NoReturn:
    """Print ``inference-lab: error: <message>`` (one line), end hypercorn's supervisor if
    it started this worker (Rule 2), and exit 1. Called by ``create_app`` when the
    environment does not configure a server."""
    lines = message.strip().splitlines()
    # One write, so the lines of several failing workers never interleave.
    sys.stderr.write(f"inference-lab: error: {lines[0] if lines else 'failed'}\n")
    sys.stderr.flush()
    supervisor = hypercorn_supervisor()
    if supervisor is not None:
        _release_supervisor_semaphores()
        with contextlib.suppress(OSError):  # gone already: nothing more to do
            os.kill(supervisor, signal.SIGKILL)
    raise SystemExit(1)


def _semaphores(value: Any, depth: int = 0) -> Iterator[mp_sync.SemLock]:
    """The semaphores inside a ``multiprocessing`` Event or Condition (or one itself)."""
    if isinstance(value, mp_sync.SemLock):
        yield value
    elif isinstance(value, mp_sync.Event | mp_sync.Condition) and depth < 3:
        for part in vars(value).values():
            yield from _semaphores(part, depth + 1)


def _release_supervisor_semaphores() -> None:
    """Rule 3: unlink and unregister the semaphores among this worker's arguments from
    hypercorn's supervisor (the arguments of its ``multiprocessing`` target)."""
    arguments = getattr(multiprocessing.current_process(), "_kwargs", None)
    if not isinstance(arguments, dict):
        return
    for value in arguments.values():
        for semaphore in _semaphores(value):
            name = getattr(getattr(semaphore, "_semlock", None), "name", None)
            if not isinstance(name, str):
                continue
            try:
                mp_sync.sem_unlink(name)  # type: ignore[attr-defined]
            except OSError:
                continue  # another failing worker got there first (unlinking is atomic)
            resource_tracker.unregister(name, "semaphore")
