"""Capacity planning (``inference-lab plan``): which deployment serves a workload within
its SLOs at the lowest cost. ``spec`` (the candidate space), ``jobs`` (one simulation, a
pure function), ``cache``, ``backends`` / ``ray_backend`` (where jobs run), ``search``
(the rate search), ``planner``, ``report``, ``cli``. Never imports the serve stack."""
