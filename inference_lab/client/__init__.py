"""The trio load client: ``inference-lab load`` and its reusable parts.

Depends only on the HTTP API (``docs/CONTRACTS.md``): nothing here imports the server.

- ``sse``: sans-IO server-sent-events parser
- ``aimd``: pure AIMD concurrency controller
- ``http``: minimal HTTP/1.1 client (trio sockets + h11, keep-alive reuse)
- ``wire``: OpenAI request bodies, prompt sizing, stream-frame classification
- ``load``: the load generator (closed loop, open loop, adaptive)
- ``report``: summary, percentiles, text, JSON, CSV
- ``plot``: the ``--plot`` figure (matplotlib, Agg)
- ``cli``: ``add_parser`` / ``run`` / ``main``
"""
