"""Tensor and expert parallelism: one process per rank (launch.py), step plans from rank 0 to every rank
(channel.py), rank 0's worker that broadcasts them and the loop of ranks > 0 that runs them (ranks.py), a
rank's place and collectives (minidsa/common/tensor_parallel.py), the process of a rank > 0 (__main__.py:
`python -m minidsa.parallel`), the one-shot all-reduce's set-up (allreduce.py), the ranks' side of data-parallel
attention (dp_attention.py). The sharded layers are in minidsa/models/layers/parallel.py."""
