"""Which aten ops (and Triton launches) a forward step runs, by where they run: outside the decoder layers or in
layer i. On a GPU each counted op is one kernel launch of the step's CUDA graph, so the glue between the layers
(embedding, rope, the indexer's per-step metadata, the final norm, the head) shows as what it costs there.

`OpCensus` is a TorchDispatchMode: it sees every aten op, custom ops (`minidsa::*`) included, and looks inside a
custom op too (its implementation runs eagerly on the GPU, outside what inductor fuses). View and allocation ops
launch nothing and are not counted. Triton kernels run under the interpreter on CPU, whose host copies are aten
ops: each launch is counted as one `triton:<kernel>` and what it runs inside is not.
"""

from __future__ import annotations

import contextlib
from collections import Counter

from torch._library.custom_ops import OPDEFS
from torch.utils._python_dispatch import TorchDispatchMode

# Ops that allocate or only look at memory: no kernel on a GPU.
NO_KERNEL = {"empty", "empty_strided", "new_empty", "new_empty_strided", "empty_like", "lift_fresh",
             "lift_fresh_copy", "_local_scalar_dense", "set_", "resize_", "sym_size", "sym_stride", "sym_numel",
             "sym_storage_offset", "is_same_size", "_has_compatible_shallow_copy_type", "record_stream",
             "promote_types", "detach_"}
# Custom ops whose CPU implementation is not what serves them on a GPU (the fused MoE's torch reference): one
# launch each here, their insides not counted.
OPAQUE = {"fused_moe"}


def _is_view(func) -> bool:
    returns = func._schema.returns
    return bool(returns) and all(r.alias_info is not None and not r.alias_info.is_write for r in returns)


class OpCensus(TorchDispatchMode):
    """Counts launches per place (`place`: "outside", "layer 0", ...)."""

    def __init__(self):
        super().__init__()
        self.place = "outside"
        self.ops: dict[str, Counter] = {}
        self._in_triton = 0

    def record(self, name: str) -> None:
        self.ops.setdefault(self.place, Counter())[name] += 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self._in_triton:
            return func(*args, **kwargs)
        name = func.overloadpacket.__name__
        if func.namespace == "minidsa":
            self.record(f"minidsa.{name}")
            if name in OPAQUE:
                return self.opaque(func)(*args, **kwargs)
            # Look inside the custom op (its torch ops launch kernels of their own): its Python implementation,
            # called with this mode on again.
            opdef = OPDEFS[f"minidsa::{name}"]
            with self:
                return opdef._backend_fns.get("cpu", opdef._init_fn)(*args, **kwargs)
        if func.namespace == "aten" and name not in NO_KERNEL and not _is_view(func):
            self.record(name)
        return func(*args, **kwargs)

    def opaque(self, fn, name: str | None = None):
        """`fn` counted as one launch named `name` (None: not counted), what it runs inside as none."""
        def call(*args, **kwargs):
            if name is not None:
                self.record(name)
            self._in_triton += 1
            try:
                return fn(*args, **kwargs)
            finally:
                self._in_triton -= 1
        return call

    @contextlib.contextmanager
    def triton_launches(self):
        """Within: each interpreted Triton launch counts as one op, its host copies as none."""
        from triton.runtime import interpreter

        original = interpreter.GridExecutor.__call__
        census = self

        def launch(executor, *args, **kwargs):
            return census.opaque(original, f"triton:{executor.fn.__name__}")(executor, *args, **kwargs)

        interpreter.GridExecutor.__call__ = launch
        try:
            yield
        finally:
            interpreter.GridExecutor.__call__ = original

    def counting_layers(self, run_layer):
        """`run_layer` (the model's per-layer call) with the census's place set to the layer while it runs."""
        def run(layer, *args):
            self.place = f"layer {layer.self_attn.layer_id}"
            try:
                return run_layer(layer, *args)
            finally:
                self.place = "outside"
        return run

    def kernels(self, place: str) -> dict[str, int]:
        """The launches at `place`, by name (a custom op's own entry, `minidsa.*`, counts what it runs, not itself;
        an opaque one is counted as itself)."""
        return {k: v for k, v in self.ops.get(place, Counter()).items()
                if not k.startswith("minidsa.") or k.split(".", 1)[1] in OPAQUE}

    def total(self, place: str) -> int:
        return sum(self.kernels(place).values())

    def describe(self) -> str:
        lines = []
        for place, ops in self.ops.items():
            lines.append(f"{place}: {sum(ops.values())} ops: " + ", ".join(f"{k} x{v}" if v > 1 else k
                                                                        for k, v in sorted(ops.items())))
        return "\n".join(lines)
