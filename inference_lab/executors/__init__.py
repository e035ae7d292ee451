"""Where pure jobs run (``backends``: in this process, a process pool; ``ray_backend``:
Ray tasks, with the ``ray`` extra): the planner's simulations and the sharded
simulator's shards. Imports nothing of the package above it; Ray only from
``ray_backend``."""
