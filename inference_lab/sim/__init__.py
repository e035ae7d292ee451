"""The offline simulator: workloads, the simulation loop, its summaries and its CLI."""
