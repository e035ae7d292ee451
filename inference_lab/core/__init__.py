"""The pure core: configs, the roofline step-cost model and the discrete-event engine.

Nothing here does I/O or reads a clock: no trio, quart, hypercorn, ``time``, ``random`` or
asyncio (``tests/test_engine.py`` walks this folder's imports). Time and random generators
are arguments.
"""
