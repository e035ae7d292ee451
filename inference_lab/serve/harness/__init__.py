"""The test harness: faults on cue, scripted answers, engine kill / restart / slowdown.

Client test suites (SDK retries, gateway failover, circuit breakers, liveness probes) need
a server that fails the way real ones do; ``docs/test-harness.md`` is the user's guide.
By concern (dependencies run downwards):

- :mod:`~inference_lab.serve.harness.directives`: the fault header and the scripted marker;
- :mod:`~inference_lab.serve.harness.frames`: the frames of the harness's answers;
- :mod:`~inference_lab.serve.harness.wire`: ASGI sends, the stream, the connection reset;
- :mod:`~inference_lab.serve.harness.host`: what the harness needs of the app's state;
- :mod:`~inference_lab.serve.harness.answers`: fault-injected streams, scripted answers;
- :mod:`~inference_lab.serve.harness.intercept`: :class:`Harness`, which picks the answer;
- :mod:`~inference_lab.serve.harness.control`: ``POST /control/engine``.
"""
