"""The project's one error hierarchy.

Each class says who raises it and what the caller should do. Errors are mapped to HTTP in
exactly one place (the serve app); CLIs print ``str(error)`` on one line and exit 1.
"""

from __future__ import annotations


class InferenceLabError(Exception):
    """Base class of every error this package raises on purpose."""


class ConfigError(InferenceLabError):
    """Raised by :mod:`inference_lab.config` for a file that cannot be used.

    ``str(error)`` is one line naming the file and the key path, e.g.
    ``configs/gpt-oss-20b.toml: scheduler.max_num_seqs: must be >= 1, got 0``.
    Callers print it and stop; nothing was loaded.
    """


class RequestRefused(InferenceLabError):
    """Raised by :meth:`Engine.submit` (and returned by ``check_fits``) for a request that
    can never run on the deployment.

    ``limit`` names the limit (``max_seq_len``, ``kv_cache`` or ``batch_tokens``) and
    ``reason`` says which limit and both numbers. The serving layer answers 400
    ``context_length_exceeded``; the offline simulator counts the request as refused.
    """

    def __init__(self, limit: str, reason: str) -> None:
        super().__init__(reason)
        self.limit = limit
        self.reason = reason
