"""The scheduler side of the control plane: which requests run each step (scheduler.py), the host-side KV page and
req_to_token row allocators (pages.py), the prefix cache (prefix_cache.py). The step plans it makes are
minidsa/common/plan.py's."""
