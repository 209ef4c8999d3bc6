"""Tensor and expert parallelism: one process per rank (launch.py), step plans from rank 0 to every rank
(plan.py), rank 0's worker that broadcasts them and the loop of ranks > 0 that runs them (executor.py), a
rank's place and collectives (parallel_state.py), the process of a rank > 0 (worker.py). The sharded layers
are in minidsa/layers/parallel.py."""
