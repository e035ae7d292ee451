"""Capacity planning (``inference-lab plan``): which deployment serves a workload within
its SLOs at the lowest cost. ``spec`` (the candidate space), ``jobs`` (one simulation, a
pure function, run by an executor of :mod:`inference_lab.executors`), ``cache``,
``search`` (the rate search), ``planner``, ``report``, ``cli``. Never imports the serve
stack."""
