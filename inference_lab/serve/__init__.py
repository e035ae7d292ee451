"""``inference-lab serve``: an OpenAI-compatible HTTP API over simulated, paced engines.

The package, by concern (dependencies run downwards):

- :mod:`~inference_lab.serve.settings`: flags and environment -> :class:`ServeSettings`;
- :mod:`~inference_lab.serve.metrics`: the Prometheus recorder and collector, Retry-After;
- :mod:`~inference_lab.serve.state`: the runtimes of one app and their lifecycle;
- :mod:`~inference_lab.serve.error_replies`: every error and refusal as an HTTP reply;
- :mod:`~inference_lab.serve.exchange`: one request as the app sees it;
- :mod:`~inference_lab.serve.streaming`: per-request sinks and frame delivery;
- :mod:`~inference_lab.serve.completions`: the two completion routes on raw ASGI;
- :mod:`~inference_lab.serve.harness`: fault injection, scripted answers, engine control
  (``--enable-test-harness``);
- :mod:`~inference_lab.serve.gate`: what every request passes first (paths, CORS, keys,
  tokens, content type, request ids);
- :mod:`~inference_lab.serve.routes`: the Quart routes (health, models, control, metrics);
- :mod:`~inference_lab.serve.asgi`: the ASGI connection where every request enters;
- :mod:`~inference_lab.serve.warmup`: the start-up warm-up of the completion path;
- :mod:`~inference_lab.serve.app`: :func:`create_app`.

``hypercorn --worker-class trio 'inference_lab.serve:create_app()'`` serves the app
configured from ``INFERENCE_LAB_*`` variables.
"""

from inference_lab.serve.app import create_app
from inference_lab.serve.asgi import get_state
from inference_lab.serve.settings import (
    DEFAULT_HARDWARE,
    DEFAULT_MAX_TOKENS,
    ServeSettings,
    load_settings,
)
from inference_lab.serve.settings_env import parse_int_setting, settings_from_env
from inference_lab.serve.state import ServeState

__all__ = [
    "DEFAULT_HARDWARE",
    "DEFAULT_MAX_TOKENS",
    "ServeSettings",
    "ServeState",
    "create_app",
    "get_state",
    "load_settings",
    "parse_int_setting",
    "settings_from_env",
]
