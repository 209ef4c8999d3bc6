"""The scheduler side of the control plane: which requests run each step, prefix cache, the step plan."""
