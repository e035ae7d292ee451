"""What the harness needs of the app's serving state, as a protocol.

The harness never imports :mod:`inference_lab.serve.state`, which builds it: the state
passes itself in, typed by this protocol, so the two stay out of an import circle.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

from inference_lab.errors import ApiError
from inference_lab.runtime.model_runtime import ModelRuntime

__all__ = ["HarnessHost"]


class HarnessHost(Protocol):
    """What the harness needs of the app's serving state (``ServeState`` is one)."""

    @property
    def runtimes(self) -> Mapping[str, ModelRuntime]:
        """The served models' runtimes by name."""

    @property
    def draining(self) -> bool:
        """A shutdown has begun: new requests are refused."""

    @property
    def shutdown_message(self) -> str | None:
        """Set when a shutdown stopped the runtimes: the message live requests end with."""

    async def restart_runtime(self, name: str) -> ModelRuntime:
        """Replace model ``name``'s runtime by a fresh one; the new runtime."""

    def model_not_found(self, model: str) -> ApiError:
        """The 404 for a model the app does not serve."""
