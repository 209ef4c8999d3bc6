"""Tensor and expert parallelism: one process per rank (launch.py), plans from rank 0 to every rank (plan.py),
the adapter between the engine and the ranks (executor.py), a rank's place and collectives (parallel_state.py).
The sharded layers are in minidsa/layers/parallel.py."""
