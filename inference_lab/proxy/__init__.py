"""``inference-lab proxy``: a prefill/decode proxy in front of ``serve --role prefill`` and
``serve --role decode`` servers, doing the two-step hand-off of vLLM's toy proxy and llm-d's
routing sidecar (``docs/disaggregation.md``, "In serve").

It talks to its backends over HTTP only, with the load client's HTTP/1.1 stack
(``client/http.py``), and is served by hypercorn's trio worker through the server's
transport interface (``serve/transport``): ``backends.py`` (the pools and one exchange),
``handoff.py`` (the two steps), ``app.py`` (the ASGI app), ``cli.py`` (the command).
"""
