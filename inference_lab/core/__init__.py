"""The pure core: configs, the roofline step-cost model, the discrete-event engine and its
KV cache (block pool and manager).

Nothing here does I/O or reads a clock: no trio, quart, hypercorn, ``time``, ``random`` or
asyncio (``tests/test_layers.py`` walks this folder's imports). Time and random generators
are arguments.
"""
