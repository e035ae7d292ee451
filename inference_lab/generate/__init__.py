"""Generated content, pure: what a response is made of when no model runs.

- :mod:`~inference_lab.generate.vocabulary`: the placeholder words every generated text
  is made of;
- :mod:`~inference_lab.generate.instances`: instances of a JSON Schema (tool-call
  arguments, structured outputs);
- :mod:`~inference_lab.generate.patterns`: strings matching a regular expression.

Below the wire format (``api/`` imports it) and the server: it imports nothing of the
package outside itself, no I/O and no clock; every choice comes from the caller's
``random.Random``.
"""
