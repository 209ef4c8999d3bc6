"""Execution: the only owner of device state (worker, model runner, CUDA graphs, the KV caches and the req_to_token
table, sampler). Which pages and rows are free is the control plane's (minidsa/sched/pages.py)."""
