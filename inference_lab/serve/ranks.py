"""``inference-lab serve --data-parallel-size N``: N complete servers, each in a process of
its own, on consecutive ports, under one supervising parent.

This is vLLM's external load-balancer layout (llm-d's): rank ``r`` is a whole server on
``--port + r`` -- its own trio runtime and engines, admission (529 / 503), ``/metrics``
(``engine`` labels from ``r``: ``serve/metrics.py`` Rule 8), ``/control/*`` and KV
events (ports offset by ``r``: ``serve/kv_events.py`` Rule 1) -- and a load balancer
spreads requests over the ranks. Each rank is ``inference-lab serve --data-parallel-rank
r``, which a user may also start by hand (one rank per container). Not to be confused
with data-parallel *attention* (a deployment's ``dp_attention``): ranks of one engine in
lockstep, inside one server.

Rule 1: the ports ``P .. P + N - 1`` are tried before any rank starts; one already taken
        is a one-line error naming it, and nothing is started. ``--port 0`` takes N free
        consecutive ports.
Rule 2: a rank is a child process of this interpreter running the serve command with the
        parent's parsed flags (pickled over its stdin), ``--data-parallel-rank r`` and
        ``--port P + r``. It runs in its own session, so a terminal's Ctrl-C reaches the
        parent alone, which passes it on once. The parent holds the pipe open while the
        rank runs: when it closes -- the parent died, however -- the rank SIGTERMs
        itself, so no rank outlives a killed parent.
Rule 3: start-up: every rank starts at once; the parent prints one banner (the models,
        each rank's URL and pid) once every rank printed its ``listening on`` line. A rank
        that exits before then fails the start: the others are stopped, the parent
        prints the rank's error as its one line and exits 1.
Rule 4: after start-up a rank that exits is reported on stderr and started again after a
        back-off (:data:`BACKOFF_START` s, doubled on each failure up to
        :data:`BACKOFF_MAX`; back to the start once a rank has served
        :data:`BACKOFF_RESET` s); the other ranks serve on. A rank's stderr is passed on,
        each line naming the rank.
Rule 5: SIGINT / SIGTERM are passed to every rank, which drains as a single server does
        (a second signal hurries live requests, a third stops at once); no rank is
        started again, and the parent exits 0 once every rank has exited.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import AsyncIterator, Callable

import attrs
import trio

from inference_lab.serve.server import bind_socket

__all__ = ["BACKOFF_MAX", "BACKOFF_RESET", "BACKOFF_START", "RankError", "plan_ports", "run_ranks"]

#: Seconds before the first restart of a rank that exited (Rule 4).
BACKOFF_START = 1.0
#: The longest wait before a restart.
BACKOFF_MAX = 30.0
#: Seconds a rank must have served for its next restart to wait only BACKOFF_START again.
BACKOFF_RESET = 60.0
#: Seconds ranks get to exit after the stop signal's last forward before they are killed
#: (only when the parent itself is cancelled: a signalled stop waits for the drains).
KILL_AFTER = 10.0
#: The line of a rank's banner that says it serves (serve/cli.py's banner).
_LISTENING = "listening on "
_PROG = "inference-lab serve"


class RankError(Exception):
    """The ranks cannot start: the message is the parent's one line."""


@attrs.frozen
class RankPort:
    """Rank ``rank``'s port (Rule 1)."""

    rank: int
    port: int


def plan_ports(host: str, port: int, size: int) -> list[RankPort]:
    """The ranks' ports, ``port + r``, each tried by binding it (then released); with
    ``port`` 0, ``size`` free consecutive ports. RankError names a port that is taken.
    Called by :func:`run_ranks` before anything starts (Rule 1)."""
    if port == 0:
        for _ in range(50):
            first = bind_socket(host, 0, 1)
            base = first.getsockname()[1]
            first.close()
            if base + size - 1 <= 65535 and _free_range(host, base, size) is None:
                return [RankPort(r, base + r) for r in range(size)]
        raise RankError(f"found no {size} free consecutive ports on {host}")
    taken = _free_range(host, port, size)
    if taken is not None:
        rank, exc = taken
        raise RankError(
            f"port {port + rank} (rank {rank} of --data-parallel-size {size}) is not free "
            f"on {host}: {exc.strerror or exc}"
        )
    return [RankPort(r, port + r) for r in range(size)]


def _free_range(host: str, port: int, size: int) -> tuple[int, OSError] | None:
    """None when ``port .. port + size - 1`` can all be bound, else the first rank whose
    port cannot and the error."""
    held: list[socket.socket] = []
    try:
        for r in range(size):
            try:
                held.append(bind_socket(host, port + r, 1))
            except OSError as exc:
                return r, exc
        return None
    finally:
        for sock in held:
            sock.close()


@attrs.define
class _Rank:
    """One rank's process and what it printed (the supervisor's own)."""

    port: RankPort
    process: trio.Process | None = None
    ready: trio.Event = attrs.Factory(trio.Event)
    settled: trio.Event = attrs.Factory(trio.Event)
    url: str = ""
    body: list[str] = attrs.Factory(list)
    errors: list[str] = attrs.Factory(list)
    ready_at: float = 0.0
    delay: float = BACKOFF_START

    @property
    def name(self) -> str:
        return f"rank {self.port.rank}"


class _Supervisor:
    """The parent (Rules 3-5)."""

    def __init__(
        self, args: argparse.Namespace, ports: list[RankPort], entry: Callable[..., int]
    ) -> None:
        self.args = args
        #: What a rank runs with its flags (the serve command's ``run``, pickled by name).
        self.entry = entry
        self.ranks = [_Rank(p) for p in ports]
        self.stopping = trio.Event()
        self.size = len(ports)
        #: Set when the start failed: the ranks' lines are no longer passed on.
        self.quiet = False

    async def spawn(self, rank: _Rank, nursery: trio.Nursery) -> None:
        """Start ``rank``'s process (Rule 2) and the tasks that read it."""
        args = argparse.Namespace(**vars(self.args))
        args.data_parallel_rank, args.port = rank.port.rank, rank.port.port
        payload = pickle.dumps((os.getpid(), self.entry, args))
        rank.ready, rank.settled = trio.Event(), trio.Event()
        rank.body, rank.errors = [], []
        process = await trio.lowlevel.open_process(
            [sys.executable, "-m", "inference_lab.serve.ranks"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        rank.process = process
        assert process.stdin is not None
        with contextlib.suppress(trio.BrokenResourceError):
            await process.stdin.send_all(payload)  # kept open: the rank's lifeline
        nursery.start_soon(self._read_stdout, rank, process)
        nursery.start_soon(self._read_stderr, rank, process)

    async def _read_stdout(self, rank: _Rank, process: trio.Process) -> None:
        assert process.stdout is not None
        async for line in _lines(process.stdout):
            if self.quiet:
                continue
            if rank.ready.is_set():
                print(f"{_PROG}: {rank.name}: {line}", flush=True)
            elif line.startswith(_LISTENING):
                rank.url = line[len(_LISTENING) :].split()[0]
                rank.ready_at = trio.current_time()
                rank.ready.set()
                rank.settled.set()
            else:
                rank.body.append(line)

    async def _read_stderr(self, rank: _Rank, process: trio.Process) -> None:
        assert process.stderr is not None
        async for line in _lines(process.stderr):
            if self.quiet:
                continue
            if rank.ready.is_set():
                tail = line.removeprefix(f"{_PROG}: ")
                print(f"{_PROG}: {rank.name}: {tail}", file=sys.stderr, flush=True)
            else:
                rank.errors.append(line)  # start-up notes repeat the parent's (Rule 3)
        await process.wait()
        assert process.stdin is not None
        await process.stdin.aclose()
        rank.settled.set()

    def signal_all(self, signum: int) -> None:
        for rank in self.ranks:
            if rank.process is not None and rank.process.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    rank.process.send_signal(signum)

    async def watch_signals(self, signals: AsyncIterator[int]) -> None:
        """Rule 5: every signal goes to every rank; the first one stops restarts."""
        async for signum in signals:
            if not self.stopping.is_set():
                name = signal.Signals(signum).name
                print(
                    f"{_PROG}: {name}: stopping {self.size} ranks (each drains as one server does)",
                    file=sys.stderr,
                    flush=True,
                )
            self.stopping.set()
            self.signal_all(signum)

    def failure(self) -> str:
        """Rule 3: the first rank that exited before it served, as the parent's line."""
        for rank in self.ranks:
            if rank.ready.is_set() or not rank.settled.is_set():
                continue
            return f"{rank.name} (port {rank.port.port}) did not start: {_why(rank)}"
        return "no rank started"

    async def keep(self, rank: _Rank, nursery: trio.Nursery) -> None:
        """Rule 4: restart ``rank`` whenever it exits, until the stop."""
        while True:
            assert rank.process is not None
            await rank.process.wait()
            if self.stopping.is_set():
                return
            served = rank.ready.is_set()
            if served and trio.current_time() - rank.ready_at >= BACKOFF_RESET:
                rank.delay = BACKOFF_START
            note = "" if served else " before it served"
            print(
                f"{_PROG}: {rank.name} (pid {rank.process.pid}) exited{note}: "
                f"{_why(rank)}; restarting in {rank.delay:g} s",
                file=sys.stderr,
                flush=True,
            )
            with trio.move_on_after(rank.delay):
                await self.stopping.wait()
            if self.stopping.is_set():
                return
            rank.delay = min(rank.delay * 2, BACKOFF_MAX)
            await self.spawn(rank, nursery)
            if self.stopping.is_set():  # signalled while it was being started
                self.signal_all(signal.SIGTERM)
            await rank.settled.wait()
            if rank.ready.is_set():
                print(
                    f"{_PROG}: {rank.name} restarted: {rank.url} (pid {rank.process.pid})",
                    file=sys.stderr,
                    flush=True,
                )

    async def wait_all(self) -> None:
        for rank in self.ranks:
            if rank.process is not None:
                await rank.process.wait()


async def _lines(stream: trio.abc.ReceiveStream) -> AsyncIterator[str]:
    """The lines of ``stream`` (decoded, without their newline) until it ends."""
    pending = b""
    async for chunk in stream:
        pending += chunk
        *whole, pending = pending.split(b"\n")
        for line in whole:
            yield line.decode("utf-8", "replace")
    if pending:
        yield pending.decode("utf-8", "replace")


def _why(rank: _Rank) -> str:
    """Why ``rank`` exited: its last start-up error line, else its exit status."""
    found = [e for e in rank.errors if ": error: " in e]
    if found and not rank.ready.is_set():
        return found[-1].split(": error: ", 1)[1]
    return _exit_text(rank.process.returncode if rank.process is not None else None)


def _exit_text(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"killed by {signal.Signals(-code).name}"
    return f"exit code {code}"


def _banner(sup: _Supervisor, models: list[str]) -> str:
    """Rule 3: the models (from the parent's settings), each rank's KV-event lines, URL
    and pid, and rank 0's URL first on the ``listening on`` line."""
    lines = list(models)
    for rank in sup.ranks:
        lines.extend(f"  {rank.name}:{line[1:]}" for line in rank.body if "KV events" in line)
    lines.append(f"  data-parallel ranks: {sup.size} processes (--data-parallel-size)")
    for rank in sup.ranks:
        pid = rank.process.pid if rank.process is not None else "-"
        lines.append(f"    {rank.name}  {rank.url}  (pid {pid})")
    urls = " ".join(rank.url for rank in sup.ranks)
    lines.append(f"{_LISTENING}{urls}  (Ctrl-C to stop)")
    return "\n".join(lines)


async def _supervise(
    args: argparse.Namespace, ports: list[RankPort], models: list[str], entry: Callable[..., int]
) -> int:
    sup = _Supervisor(args, ports, entry)
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(sup.watch_signals, signals)
            try:
                return await _serve(sup, nursery, models)
            finally:
                with trio.CancelScope(shield=True):
                    await _reap(sup)
                nursery.cancel_scope.cancel()
    raise AssertionError("unreachable")  # pragma: no cover - the nursery body returns


async def _serve(sup: _Supervisor, nursery: trio.Nursery, models: list[str]) -> int:
    """Rules 3-5: start the ranks; fail the start, or keep them until the stop."""
    for rank in sup.ranks:
        await sup.spawn(rank, nursery)
    while not sup.stopping.is_set():
        if all(rank.ready.is_set() for rank in sup.ranks):
            break
        if any(rank.settled.is_set() and not rank.ready.is_set() for rank in sup.ranks):
            failed = sup.failure()
            sup.quiet = True  # the others' stop notes would bury the one line
            sup.stopping.set()
            sup.signal_all(signal.SIGTERM)
            await sup.wait_all()
            print(f"{_PROG}: error: {failed}", file=sys.stderr, flush=True)
            return 1
        await trio.sleep(0.05)
    if not sup.stopping.is_set():
        print(_banner(sup, models), flush=True)
        for rank in sup.ranks:
            nursery.start_soon(sup.keep, rank, nursery)
    await sup.stopping.wait()
    await sup.wait_all()
    return 0


async def _reap(sup: _Supervisor) -> None:
    """No rank outlives the parent: SIGTERM what still runs, SIGKILL after KILL_AFTER."""
    if all(r.process is None or r.process.returncode is not None for r in sup.ranks):
        return
    sup.signal_all(signal.SIGTERM)
    with trio.move_on_after(KILL_AFTER):
        await sup.wait_all()
        return
    sup.signal_all(signal.SIGKILL)
    await sup.wait_all()


def run_ranks(
    args: argparse.Namespace,
    models: list[str],
    notes: Callable[[], None],
    entry: Callable[[argparse.Namespace], int],
) -> int:
    """Serve ``args`` as ``args.data_parallel_size`` rank processes (the module's rules),
    each running ``entry(args)`` (a module-level function: it is pickled by name);
    ``models`` are the banner's model lines, ``notes`` prints the start-up warnings once.
    Called by ``serve/cli.py``'s ``run`` once the settings loaded; returns the exit code."""
    from inference_lab.cli_args import fail

    try:
        ports = plan_ports(args.host, args.port, args.data_parallel_size)
    except (RankError, OSError) as exc:
        return fail(_PROG, str(exc))
    notes()
    try:
        return trio.run(_supervise, args, ports, models, entry)
    except KeyboardInterrupt:  # a signal before the handlers were installed
        return 0


def _lifeline(fd: int) -> None:
    """Rule 2: wait for the parent's end of the pipe to close, then SIGTERM this rank
    (unbuffered reads: a daemon thread must hold no lock at interpreter exit)."""
    while os.read(fd, 4096):
        pass
    os.kill(os.getpid(), signal.SIGTERM)


def _child() -> int:
    """A rank's process (Rule 2): the parent's flags from stdin, then the serve command."""
    parent, entry, args = pickle.load(sys.stdin.buffer)  # noqa: S301 - our parent's pipe
    if os.getppid() != parent:  # the parent died already
        return 1
    threading.Thread(
        target=_lifeline, args=(sys.stdin.fileno(),), daemon=True, name="lifeline"
    ).start()
    code: int = entry(args)
    return code


if __name__ == "__main__":
    sys.exit(_child())
