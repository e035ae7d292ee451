"""The trio load client: ``inference-lab load`` and its reusable parts.

It talks to a server only over the HTTP API: nothing here imports the server side of the
package (a test walks the imports).

- ``sse``: sans-IO server-sent-events parser
- ``aimd``: pure AIMD concurrency controller
- ``http``: minimal HTTP/1.1 client (h11 over an injectable transport, keep-alive reuse)
- ``wire``: OpenAI request bodies, prompt sizing, stream-frame classification
- ``load``: the load generator (closed loop, open loop, adaptive)
- ``load_records``: its values: the run's ``LoadConfig``, each attempt's record, the result
- ``report``: summary, percentiles, text, JSON, CSV
- ``plot``: the ``--plot`` figure (matplotlib, Agg; the ``plot`` extra)
- ``cli``: the ``load`` subcommand (``add_parser`` / ``run``)
"""
