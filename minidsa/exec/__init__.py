"""Execution: the only owner of device state (worker, model runner, CUDA graphs, KV cache, sampler)."""
