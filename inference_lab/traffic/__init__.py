"""Traffic shapes: block-hash chains, multi-turn sessions, trace files, rate schedules.

Pure and shared: no engine, no simulator, no clock, no network. The offline simulator
turns these shapes into engine requests; a client replaying them against a server can
read the same files with the same code.
"""
