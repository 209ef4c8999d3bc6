"""Execution: the only owner of device state (worker, model runner, CUDA graphs; the KV caches, the req_to_token
table and the sampler it builds are defined in minidsa/common/). Which pages and rows are free is the control
plane's (minidsa/sched/pages.py)."""
