"""DeepGEMM's start-up warm-up, all of it: its FP8 GEMM kernels compiled by a pool of processes, then loaded (and
what the pool left compiled) in the engine's process, and the start-up log line saying which weight shapes
DeepGEMM serves and which the Triton GEMM serves, and why.

The pieces: `gemm_tasks` / `grouped_tasks` (every class serving can ask for), `JitPool` (the processes),
`Building` (the pool's registry of the classes it has not built yet), `warm_up_fp8_gemms` (the in-process runs),
`GemmWarmUp` (one model's warm-up, held by the runner). kernels/deepgemm.py, the serving functions, keeps no
state: while the activation profile runs beside the pool (`GemmWarmUp.beside_pool`), the custom ops
(kernels/custom_ops.py) reach the pool's registry through `building()`, a context variable set only for the
profile, and decide before calling DeepGEMM: a dense class still building runs on the Triton GEMM (counted for
the log line), a grouped one waits (`deepgemm.moe_contiguous`'s `building`). Outside the profile `building()` is
None: serving never consults it, and engines in one process never see each other's pool. Those profile calls are
no shape DeepGEMM declines (it takes every projection of DeepSeek-V3.2 and GLM-5 at tensor parallelism 1-8 and
the MTP layer's, e.g. the fused q_a|wk|kv_a [2240, 7168] and TP=2's dense down [7168, 9216], whose classes a
slower pool at TP, its CPUs shared by the ranks, had not built yet); they used to reach the console as a WARNING
per shape, and are now named once, in the INFO line `GemmWarmUp.load` logs (`gemm_summary`).

DeepGEMM JIT-compiles one kernel per tile choice with nvcc, and the choice follows the GEMM's rows: the
in-process warm-up (`warm_up_fp8_gemms`) runs every row class of every weight shape once, 499 calls for
bench-dsv32, one nvcc after another (198 s on a fresh H100 before this pool: benchmarks/archive/STARTUP.md). What
DeepGEMM's JIT does (its
`csrc/jit/compiler.hpp` on the `dev` branch):
- kernels live in `$DG_JIT_CACHE_DIR/cache/kernel.<name>.<hash of the generated code and nvcc flags>/`
  (default `~/.deep_gemm`); a kernel is compiled into `tmp/<uuid>` and renamed into place, so processes may
  compile into one cache at the same time (the rename of a kernel another process finished first fails and
  is dropped); a later call, in any process, loads it from disk;
- M, N and K are not compiled in (fp8_gemm_nt's `compiled_dims` is empty): a kernel is the tile config
  (block sizes, stages, multicast, SM count) chosen from (M, N, K), so many row classes, and weight shapes,
  share one (an estimate of its heuristic gives 32 distinct kernels for those 499 calls), plus a small
  scale-transpose kernel per K;
- nvcc runs in a child process (popen) behind a process-wide kernel map that is not thread-safe, and there is
  no compile-only call: a kernel is compiled by running the GEMM.
Hence processes: `JitPool` starts `workers` processes (`python -m minidsa.kernels.deepgemm_warmup`, one CUDA
context each; before the KV cache is sized, so their memory comes back), deals them the (rows, N, K) classes
from one queue, each class to exactly one process, and each runs it on zero inputs of that shape through
`deepgemm.run_fp8_gemm`, the call serving makes. The queue interleaves the shapes and spreads each shape's row
classes (`spread`): neighbouring classes mostly share a kernel, and a kernel two processes compile at once is
compiled twice. A worker that fails or dies is reported (one warning) and its classes are left to the
engine's warm-up, which compiles what is missing itself.

The routed experts' contiguous grouped GEMM (`deepgemm.moe_contiguous`, prefill steps) is the same kind of JIT, N,
K and the expert count compiled in, the tile choice following the rows, which the routing decides: a
`GroupedRows` task runs every row count serving can hand it, largest first, in one worker (its
neighbouring row counts share a kernel: one worker compiles it once), every row padding (-1: DeepGEMM multiplies
nothing). These are dealt out first: the activation profile's MoE waits for its row count (compiled here instead,
it held the engine's main thread ~15 s with the GIL).

A manifest in the cache dir (`manifest_path`) records that every class of a task list was built there; the next
start with the same tasks, GPU and DeepGEMM build skips the pool while the kernels it lists are still there.
"""

from __future__ import annotations

import collections
import contextlib
import contextvars
import hashlib
import json
import logging
import os
import select
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Iterator, NamedTuple

import torch

from minidsa.kernels import deepgemm
from minidsa.kernels.optional_lib import LibraryCallFailed

logger = logging.getLogger(__name__)

Task = tuple[int, int, int]  # (rows, N, K) of one fp8_gemm_nt call
TASK_TIMEOUT_S = 600.0  # one class: an nvcc run takes seconds; a worker silent this long is stopped
# Per worker: the CUDA context and allocator slack, plus the largest class's tensors (`_task_bytes`).
WORKER_BASE_BYTES = 1 << 30


# ---------------------------------------------------------------- what the warm-up runs

def gemm_row_classes(max_rows: int) -> list[int]:
    """Every `deepgemm.gemm_rows` value of 1..max_rows."""
    classes, m = [], 1
    while m <= max_rows:
        classes.append(deepgemm.gemm_rows(m))
        m = classes[-1] + 1
    return classes


def gemm_tasks(weight_shapes: list[tuple[int, int]], max_rows: int) -> list[tuple[int, int, int]]:
    """(rows, N, K) of every fp8_gemm_nt call serving can make up to `max_rows` rows: each row class DeepGEMM
    serves (`deepgemm.fp8_gemm_wins`; the Triton GEMM takes the rest) of each distinct [N, K] weight shape it takes
    (`deepgemm.gemm_unsupported`)."""
    tasks, seen, classes = [], set(), gemm_row_classes(max_rows)
    for n, k in weight_shapes:
        if (n, k) in seen or deepgemm.gemm_unsupported(n, k) is not None:
            continue
        seen.add((n, k))
        tasks += [(rows, n, k) for rows in classes if deepgemm.fp8_gemm_wins(rows, n, k)]
    return tasks


class GroupedRows(NamedTuple):
    """Every row count `moe_contiguous` can hand the contiguous grouped GEMM for one expert weight [groups, N, K]:
    the multiples of `step` (DeepGEMM's alignment) from `first` to `last`. DeepGEMM picks the kernel (block N,
    stages, multicast; N, K and the groups compiled in) from the rows, and the routing decides the rows: the
    start-up pool (`JitPool`) runs each row count once, so no step compiles one (~15 s of nvcc)."""

    groups: int
    n: int
    k: int
    first: int
    last: int
    step: int

    def classes(self) -> list[tuple[int, int, int, int]]:
        """(rows, N, K, groups) of each row count, largest first (the activation profile's largest step)."""
        return [(m, self.n, self.k, self.groups) for m in range(self.last, self.first - 1, -self.step)]


def grouped_tasks(experts: list[tuple[tuple[int, int, int], int, bool]], alignment: int,
                  max_tokens: int) -> list[GroupedRows]:
    """The grouped GEMMs' row ranges of steps of up to `max_tokens` tokens, per distinct expert shape. `experts`:
    (gate_up_proj's shape [E, 2I, H], top_k, whether every expert is on this rank) of each expert layer DeepGEMM
    serves."""
    from minidsa.kernels import moe_layout

    chunk = min(max_tokens, deepgemm.MOE_MAX_CHUNK_TOKENS)
    tasks: list[GroupedRows] = []
    for (groups, two_i, hidden), top_k, all_local in experts:
        # tokens of the smallest call it takes
        fewest = -(-deepgemm.MOE_CONTIGUOUS_MIN_PAIRS_PER_EXPERT * groups // top_k)
        if hidden % 128 or two_i % 256 or fewest > chunk:
            continue  # `moe_contiguous` never takes one
        last = moe_layout.max_padded_rows(chunk * top_k, groups, alignment)
        # Each pair has a row unless its expert is on another rank; a step cut into chunks can end in a short one.
        first = -(-fewest * top_k // alignment) * alignment if all_local and max_tokens <= chunk else alignment
        for n, k in ((two_i, hidden), (hidden, two_i // 2)):
            task = GroupedRows(groups, n, k, first, last, alignment)
            if task not in tasks:
                tasks.append(task)
    return tasks


def warm_up_fp8_gemms(library: deepgemm.DeepGEMM, weights: list[tuple[torch.Tensor, torch.Tensor]],
                      max_rows: int) -> int:
    """Run fp8_gemm_nt once per row class up to `max_rows` for each distinct weight shape (`gemm_tasks`) through
    the engine's handle, so DeepGEMM has every kernel serving can ask for now: it compiles the ones its disk cache
    lacks (the pool compiled them beforehand in parallel processes) and loads the rest. Returns the calls made;
    stops at the first that fails (recorded in `library.failures`; serving then runs the Triton GEMM for each call
    DeepGEMM fails)."""
    by_shape = {tuple(w.shape): (w, s) for w, s in reversed(weights)}  # the first weight of each shape
    calls, x = 0, None
    for rows, n, k in gemm_tasks([tuple(w.shape) for w, _ in weights], max_rows):
        weight, scale_inv = by_shape[(n, k)]
        if x is None or x.shape[1] != k:  # one zero input per weight shape, sliced per class
            x = torch.zeros(gemm_row_classes(max_rows)[-1], k, dtype=torch.bfloat16, device=weight.device)
        try:
            if deepgemm.fp8_gemm_nt(library.module, x[:rows], weight, scale_inv) is None:
                return calls
        except LibraryCallFailed as e:
            library.failures.append(str(e))
            logger.error("DeepGEMM %s; the Triton FP8 GEMM serves each call DeepGEMM fails", e)
            return calls
        calls += 1
    return calls


def _shapes(shapes) -> str:
    return ", ".join("x".join(map(str, s)) for s in shapes)


def gemm_summary(weight_shapes: list[tuple[int, int]], profiled_on_triton: dict[tuple[int, ...], int] | None = None,
                 grouped: list[GroupedRows] | tuple = ()) -> str:
    """The start-up log line: which FP8 weight shapes [N, K] DeepGEMM's GEMM serves (and from how many rows),
    which the Triton GEMM serves and why, the grouped GEMM's expert shapes, and the dense classes the activation
    profile ran on Triton while the pool was still building them (DeepGEMM serves those from the warm-up on)."""
    shapes = list(dict.fromkeys(weight_shapes))
    served = [s for s in shapes if deepgemm.gemm_unsupported(*s) is None]
    big = [s for s in served if deepgemm.fp8_gemm_wins(1, *s)]
    parts = []
    if served:
        text = (f"DeepGEMM serves {len(served)} FP8 weight shape{'s' * (len(served) != 1)} (N x K: "
                f"{_shapes(served)}) from {deepgemm.FP8_GEMM_DEEPGEMM_MIN_ROWS} rows")
        if big:
            text += f", from 1 row for {_shapes(big)} (measured faster at every size)"
        parts.append(text + "; Triton serves the calls below that (measured faster there)")
    for s in shapes:
        why = deepgemm.gemm_unsupported(*s)
        if why is not None:
            parts.append(f"Triton serves {_shapes([s])} ({why})")
    if grouped:
        experts = list(dict.fromkeys((t.groups, t.n, t.k) for t in grouped))
        parts.append(f"DeepGEMM's grouped GEMM serves the routed experts ({_shapes(experts)}) from "
                     f"{deepgemm.MOE_CONTIGUOUS_MIN_PAIRS_PER_EXPERT} (token, expert) pairs per expert")
    if profiled_on_triton:
        classes = sorted(profiled_on_triton)
        parts.append(f"the activation profile ran {len(classes)} GEMM class{'es' * (len(classes) != 1)} on Triton "
                     f"while the JIT pool was still building them (rows x N x K: {_shapes(classes)}; the same "
                     f"output buffer, the same peak), DeepGEMM serves them from the warm-up on")
    return "DeepGEMM FP8 GEMMs: " + ("; ".join(parts) if parts else "no FP8 weight")


# ---------------------------------------------------------------- the pool's registry

class Building:
    """The GEMM classes a `JitPool` is still building: dense (rows, N, K) and grouped (rows, N, K, groups). The
    activation profile runs beside the pool, and must neither wait for a whole pool nor compile in this process a
    kernel a worker is compiling (~15 s of nvcc each, the GIL held): the fp8_linear op runs a dense class still
    building on the Triton GEMM (`defer`: the same output buffer, the same peak; counted in `deferred` for the
    start-up log), `deepgemm.moe_contiguous` waits for its grouped classes (the Triton fused MoE's peak is not the
    one it measures). Empty once the pool has ended. Shared by the pool's feeder threads and the profile's."""

    def __init__(self):
        self._classes: set[tuple[int, ...]] = set()
        self._changed = threading.Condition()
        self.deferred: dict[tuple[int, ...], int] = {}  # dense class -> calls the Triton GEMM served meanwhile

    def add(self, classes) -> None:
        with self._changed:
            self._classes.update(classes)

    def finish(self, classes) -> None:
        """Built, failed or given up: this process runs (or compiles) them itself from now on."""
        with self._changed:
            self._classes.difference_update(classes)
            self._changed.notify_all()

    def wait_for(self, classes) -> None:
        with self._changed:
            self._changed.wait_for(lambda: self._classes.isdisjoint(classes))

    def defer(self, cls: tuple[int, ...]) -> bool:
        """Is `cls` still building? Then this call goes to Triton, and is counted."""
        with self._changed:
            if cls not in self._classes:
                return False
            self.deferred[cls] = self.deferred.get(cls, 0) + 1
            return True

    def __contains__(self, cls) -> bool:
        with self._changed:
            return cls in self._classes

    def __bool__(self) -> bool:
        with self._changed:
            return bool(self._classes)


# The registry of the pool the current start-up's activation profile runs beside (`GemmWarmUp.beside_pool`), None
# elsewhere: a context variable, so it is set only for that profile, in the thread running it.
_BESIDE_POOL: contextvars.ContextVar[Building | None] = contextvars.ContextVar("deepgemm_beside_pool", default=None)


def building() -> Building | None:
    """The classes the pool this start-up's activation profile runs beside is still building; None outside that
    profile (serving). The custom ops ask it before they hand a class to DeepGEMM."""
    return _BESIDE_POOL.get()


# ---------------------------------------------------------------- the pool of processes

def cache_dir() -> str:
    """DeepGEMM's JIT cache directory, as its compiler resolves it."""
    return os.environ.get("DG_JIT_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".deep_gemm")


def cached_kernels(root: str | None = None) -> set[str]:
    """Names of the kernels in DeepGEMM's cache (`cache/kernel.*` directories)."""
    try:
        return {n for n in os.listdir(os.path.join(root or cache_dir(), "cache")) if n.startswith("kernel.")}
    except OSError:
        return set()


def spread(tasks: list[Task]) -> list[Task]:
    """The tasks in queue order: shapes interleaved, each shape's row classes in bit-reversed order (far apart
    first, then the gaps halve), so processes taking tasks side by side mostly meet different kernels."""
    by_shape: dict[tuple[int, int], list[Task]] = {}
    for t in tasks:
        by_shape.setdefault(t[1:], []).append(t)
    lanes = []
    for lane in by_shape.values():
        bits = max(1, (len(lane) - 1).bit_length())
        lanes.append([lane[i] for i in sorted(range(len(lane)), key=lambda i: int(f"{i:0{bits}b}"[::-1], 2))])
    return [lane[i] for i in range(max(map(len, lanes), default=0)) for lane in lanes if i < len(lane)]


def _task_bytes(task: Task | GroupedRows) -> int:
    if isinstance(task, GroupedRows):
        # the whole e4m3 weight [groups, N, K] and its scales; e4m3 rows, their scales, bf16 output at the most rows
        n, k, rows = task.n, task.k, task.last
        return task.groups * (n * k + (n * k >> 12)) + rows * k + (rows * k >> 5) + rows * n * 2 + rows * 4
    rows, n, k = task
    # e4m3 weight and its scales; bf16 input, its e4m3 copy and scales; bf16 output
    return n * k + (n * k >> 12) + rows * k * 3 + (rows * k >> 5) + rows * n * 2


def worker_count(tasks: list[Task], device: torch.device, share: int = 1, workers: int | None = None,
                 grouped: list[GroupedRows] | tuple = ()) -> int:
    """How many processes compile `tasks` and `grouped`: `workers` when the configuration sets it
    (MINIDSA_DEEPGEMM_WORKERS, read by `config.resolve`; 0: no pool), else the CPUs (nvcc is one process per
    kernel) divided among the `share` engines starting on this machine at once (tensor-parallel ranks), no more
    than there are tasks or than the free GPU memory holds (each grouped task's tensors once, in the worker
    running it; they are freed after it)."""
    if workers is not None:
        return max(0, workers)
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cpus = os.cpu_count() or 1
    count = min(max(1, cpus // max(1, share)), len(tasks) + len(grouped))
    if device.type == "cuda" and count:
        free, _ = torch.cuda.mem_get_info(device)
        budget = int(0.8 * free) - sum(map(_task_bytes, grouped))
        count = min(count, max(0, budget) // (WORKER_BASE_BYTES + max(map(_task_bytes, tasks), default=0)))
    return count


def manifest_path(tasks: list[Task], device: torch.device, root: str | None = None) -> str:
    """Where the manifest of `tasks` on this GPU and DeepGEMM build lives in the cache."""
    mod = sys.modules.get("deep_gemm")
    gpu = (torch.cuda.get_device_name(device), torch.cuda.get_device_capability(device),
           torch.cuda.get_device_properties(device).multi_processor_count) if device.type == "cuda" else device.type
    # DeepGEMM's JIT settings that change the kernels it builds (compiler, its flags): another set needs others.
    jit_env = sorted((k, v) for k, v in os.environ.items() if k.startswith("DG_JIT_") and k != "DG_JIT_CACHE_DIR")
    ident = json.dumps([sorted(tasks), gpu, getattr(mod, "__version__", None), getattr(mod, "__file__", None), jit_env])
    return os.path.join(root or cache_dir(), f"minidsa-gemms-{hashlib.sha256(ident.encode()).hexdigest()[:16]}.json")


def manifest_complete(path: str) -> bool:
    """Does the manifest exist, and is every kernel it lists still in the cache?"""
    try:
        with open(path) as f:
            kernels = set(json.load(f)["kernels"])
    except (OSError, ValueError, KeyError, TypeError):
        return False
    return kernels <= cached_kernels(os.path.dirname(path))


def write_manifest(path: str) -> None:
    """Record the kernels now in the cache as those `path`'s tasks need (after they all ran)."""
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump({"kernels": sorted(cached_kernels(os.path.dirname(path)))}, f)
        os.replace(tmp, path)
    except OSError as e:
        logger.warning("DeepGEMM JIT: could not write %s (%s); the next start checks the kernels again", path, e)


@dataclass
class JitReport:
    """What a `JitPool` did."""

    tasks: int = 0  # dense GEMM classes
    grouped: int = 0  # grouped-GEMM row counts
    workers: int = 0
    seconds: float = 0.0
    compiled: int = 0  # kernels that appeared in the cache meanwhile
    cached_before: int = 0  # kernels the cache held at the start
    skipped: str = ""  # why no pool ran, if none did
    failures: list[str] = field(default_factory=list)  # one line per failed class or worker

    def describe(self) -> str:
        if self.skipped:
            return self.skipped
        grouped = f" and {self.grouped} grouped-GEMM row counts" if self.grouped else ""
        text = (f"{self.tasks} GEMM classes{grouped} on {self.workers} processes in {self.seconds:.1f} s: "
                f"{self.compiled} kernels compiled, {self.cached_before} were in the cache")
        return text + (f"; {len(self.failures)} failed" if self.failures else "")


def _classes(task: Task | GroupedRows) -> list[tuple[int, ...]]:
    """The classes (`Building`'s keys) a queued task builds."""
    return task.classes() if isinstance(task, GroupedRows) else [task]


def _describe(task: Task | GroupedRows) -> str:
    if isinstance(task, GroupedRows):
        return f"the grouped GEMM [{task.groups}, {task.n}, {task.k}] at {task.first}-{task.last} rows"
    return "x".join(map(str, task))


class _Worker:
    """One compile process and the thread in this process that feeds it tasks from the shared queue."""

    def __init__(self, index: int, device: str, env: dict[str, str]):
        self.index = index
        self.stderr = tempfile.TemporaryFile()
        # Unbuffered: `_read` selects on the pipe, so no reply may wait in a buffer of this process (a grouped task
        # answers many lines at once).
        self.proc = subprocess.Popen([sys.executable, "-m", "minidsa.kernels.deepgemm_warmup", device], bufsize=0,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.stderr, env=env)

    def stderr_tail(self, lines: int = 3) -> str:
        self.stderr.seek(0)
        text = self.stderr.read().decode("utf-8", "replace").strip().splitlines()
        return " | ".join(text[-lines:])

    def _read(self, timeout: float) -> dict | None:
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        line = self.proc.stdout.readline() if ready else b""
        if not line:
            return None
        try:
            return json.loads(line)
        except ValueError:
            return None

    def serve(self, next_task, on_done, failures: list[str]) -> None:
        """Hand this process tasks (`next_task()`, None when there are none left) until there are none or the
        process fails; `on_done(classes, built)` as classes run or fail (a grouped task answers once per row
        count), failures recorded in `failures`."""
        hello = self._read(TASK_TIMEOUT_S)
        if hello is None or not hello.get("ready"):
            failures.append(f"worker {self.index} failed to start ({self._exit()}): "
                            f"{(hello or {}).get('error') or self.stderr_tail()}")
            return
        while (task := next_task()) is not None:
            pending = _classes(task)
            try:
                self.proc.stdin.write(json.dumps({"grouped" if isinstance(task, GroupedRows) else "dense": task})
                                      .encode() + b"\n")
                self.proc.stdin.flush()
            except OSError:
                failures.append(f"worker {self.index} died before {_describe(task)} ({self._exit()}): "
                                f"{self.stderr_tail()}")
                on_done(pending, False)
                return
            errors = []
            for i, cls in enumerate(pending):
                reply = self._read(TASK_TIMEOUT_S)
                if reply is None:
                    failures.append(f"worker {self.index} died on {_describe(task)} ({self._exit()}): "
                                    f"{self.stderr_tail()}")
                    on_done(pending[i:], False)
                    return
                if not reply.get("ok"):
                    errors.append(reply.get("error"))
                on_done([cls], bool(reply.get("ok")))
            if errors:
                failures.append(f"worker {self.index}: {_describe(task)} failed"
                                f"{f' at {len(errors)} row counts' if isinstance(task, GroupedRows) else ''}: "
                                f"{errors[0]}")

    def _exit(self) -> str:
        try:
            code = self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return "stopped: no answer"
        return f"exit code {code}"

    def end_tasks(self) -> None:
        """No more tasks: the process exits (its CUDA context torn down, which takes a while)."""
        try:
            self.proc.stdin.close()
        except OSError:
            pass

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.end_tasks()
                self.proc.wait(timeout=30)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        self.stderr.close()


class JitPool:
    """`workers` processes running `tasks` (dense classes) and `grouped` (grouped-GEMM row ranges) on `device`
    (DeepGEMM's cache: `cache_dir()`, inherited through the environment), so the kernels they need are on disk,
    while this process goes on: `start`, then `join`. Until a class has run, `building` holds it (the activation
    profile's dense calls of it go to the Triton GEMM, its grouped calls wait). The grouped ranges are dealt out
    first, then `first` (dense classes the engine runs while the pool works), then the rest. Never raises for a
    failing worker or class: the report lists them, `unbuilt` holds the grouped ranges not wholly built, and the
    caller's warm-up compiles what is missing."""

    def __init__(self, tasks: list[Task], device: torch.device, workers: int, progress: bool = True,
                 first: list[Task] | tuple = (), grouped: list[GroupedRows] | tuple = ()):
        self.tasks, self.grouped = tasks, list(grouped)
        self.classes = [c for t in [*self.grouped, *tasks] for c in _classes(t)]
        self.building = Building()
        self.report = JitReport(tasks=len(tasks), grouped=len(self.classes) - len(tasks),
                                workers=min(workers, len(tasks) + len(self.grouped)))
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.device, self.progress = device, progress
        head = set(first) & set(tasks)
        self._pending = collections.deque([*self.grouped, *spread([t for t in tasks if t in head]),
                                           *spread([t for t in tasks if t not in head])])
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._workers: list[_Worker] = []
        self._start = 0.0
        self._before: set[str] = set()  # the cache's kernels when the pool started
        self._bar = None
        self._joined = False
        self._failed: set[tuple[int, ...]] = set()  # classes that failed or were never run

    def start(self) -> "JitPool":
        report = self.report
        if not self.classes:
            report.skipped = "no GEMM classes"
            return self
        self._before = cached_kernels()
        report.cached_before = len(self._before)
        if report.workers < 1:
            report.skipped = "no worker processes (MINIDSA_DEEPGEMM_WORKERS=0, or no GPU memory free for one)"
            return self
        self._start = time.perf_counter()
        self.building.add(self.classes)
        from tqdm.auto import tqdm

        self._bar = tqdm(total=len(self.classes), desc="DeepGEMM JIT", unit="class",
                         disable=None if self.progress else True, leave=False)
        env = dict(os.environ)
        # The workers import what this process imported (deep_gemm, minidsa), from where this process found them.
        paths = [*env.get("PYTHONPATH", "").split(os.pathsep), *(os.path.abspath(p) for p in sys.path if p)]
        env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(p for p in paths if p))
        try:
            for i in range(report.workers):
                self._workers.append(_Worker(i, str(self.device), env))
            self._threads = [threading.Thread(target=w.serve, args=(self._next, self._finish, self.report.failures),
                                              daemon=True) for w in self._workers]
            for t in self._threads:
                t.start()
        except BaseException:
            self._stop()
            raise
        return self

    def _next(self) -> Task | GroupedRows | None:
        with self._lock:
            return self._pending.popleft() if self._pending else None

    def _finish(self, classes: list[tuple[int, ...]], built: bool) -> None:
        if not built:
            with self._lock:
                self._failed.update(classes)
        self.building.finish(classes)  # built (or failed: the engine's process compiles it when it runs it)
        self._bar.update(len(classes))

    def _alive(self) -> bool:
        return any(t.is_alive() for t in self._threads)

    @property
    def unbuilt(self) -> list[GroupedRows]:
        """The grouped ranges a worker failed, died on or never ran (after `join`)."""
        if not self._workers:
            return list(self.grouped)
        return [t for t in self.grouped if t in self._pending or not self._failed.isdisjoint(t.classes())]

    def join(self) -> JitReport:
        """Wait for every class, stop the processes (their GPU memory comes back), and report."""
        if self._joined or not self._workers:
            return self.report
        self._joined = True
        try:
            for t in self._threads:
                t.join()
        finally:
            self._stop()
        if self._pending:
            left = sum(len(_classes(t)) for t in self._pending)
            self.report.failures.append(f"{left} classes were not run (no worker left)")
        self.report.compiled = len(cached_kernels() - self._before)
        self.report.seconds = time.perf_counter() - self._start
        return self.report

    def abort(self) -> None:
        """Stop now: no more classes dealt out, the processes killed (the engine's start-up failed)."""
        with self._lock:
            self._pending.clear()
        for w in self._workers:
            w.proc.kill()
        self.join()

    def _stop(self) -> None:
        self.building.finish(self.classes)
        interrupted = self._alive()  # do not wait for the compilers
        for w in self._workers:  # all at once: one after another, 16 exits took ~10 s on an H100
            if interrupted:
                w.proc.kill()
            else:
                w.end_tasks()
        for w in self._workers:
            w.close()
        if self._bar is not None:
            self._bar.close()


class GemmWarmUp:
    """DeepGEMM's GEMM kernels for one model at start-up: `start_pool` / `finish_pool` (before the KV cache is
    allocated) build what the disk cache lacks in worker processes, `load` (the engine's warm-up) runs every dense
    class in this process through the engine's DeepGEMM handle, compiling only what the pool left, and the grouped
    row counts the pool did not build, then logs `summary` (one INFO line); each returns its start-up log detail.
    `beside_pool`: the context the activation profile runs in while the pool works. `experts`: ((gate_up_proj, its
    scales), (down_proj, its scales), top_k, every expert on this rank) of each expert layer DeepGEMM's grouped
    GEMM serves."""

    def __init__(self, weights: list[tuple[torch.Tensor, torch.Tensor]], max_rows: int, device: torch.device,
                 library: "deepgemm.DeepGEMM", share: int = 1, workers: int | None = None,
                 experts: list[tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor], int, bool]]
                 | tuple = ()):
        self.weights, self.max_rows, self.device, self.share, self.workers = weights, max_rows, device, share, workers
        self.library = library
        self.tasks = gemm_tasks([tuple(w.shape) for w, _ in weights], max_rows)
        contiguous = deepgemm.grouped_contiguous(library.module) if experts else None
        shapes = [(tuple(gate_up[0].shape), top_k, all_local) for gate_up, _, top_k, all_local in experts]
        self.grouped = grouped_tasks(shapes, contiguous[1], max_rows) if contiguous else []
        # The served weights, which the in-process runs of `load` use (no copy: the KV cache has the memory by then).
        self.expert_weights = {tuple(w.shape): (w, sc) for gate_up, down, _, _ in experts for w, sc in (gate_up, down)}
        self.manifest = manifest_path([*self.tasks, *self.grouped], device)
        self.pool: JitPool | None = None
        self.pool_failures: list[str] = []

    @classmethod
    def for_weights(cls, weights: list[tuple[torch.Tensor, torch.Tensor]], experts: list, max_rows: int,
                    device: torch.device, library: "deepgemm.DeepGEMM | None", share: int = 1,
                    workers: int | None = None) -> "GemmWarmUp | None":
        """None when no FP8 weight runs through DeepGEMM's GEMMs (`weights`: `layers.linear.deepgemm_weights`,
        `experts`: `deepseek_v32.deepgemm_experts`; `library`: the engine's handle, if any)."""
        if not weights and not experts:
            return None
        if library is None:
            raise ValueError("FP8 projections are given to DeepGEMM, but the engine loaded no DeepGEMM handle")
        return cls(weights, max_rows, device, library, share, workers, experts)

    def start_pool(self, first_rows: list[int] | tuple = (), progress: bool = True) -> None:
        """Start compiling what the disk cache lacks in worker processes, and return: the engine goes on beside
        them, its dense calls of classes not built yet served by the Triton GEMM and its grouped ones waiting
        (`beside_pool`), and calls `finish_pool` before sizing the KV cache, as the workers' CUDA contexts
        hold GPU memory. `first_rows`: the token counts of the steps the engine runs meanwhile; their dense classes
        are dealt out first, after the grouped ranges."""
        if self.pool is not None or manifest_complete(self.manifest):
            return
        first = {deepgemm.gemm_rows(r) for r in first_rows if r > 0}
        grouped = self.grouped
        workers = worker_count(self.tasks, self.device, self.share, self.workers, grouped)
        if workers == 0 and grouped and self.workers is None:
            # The grouped tasks' tensors leave no memory for a worker: the pool builds the dense classes, and the
            # grouped row counts are compiled in this process (the profile's, then the rest by `load`).
            grouped = []
            workers = worker_count(self.tasks, self.device, self.share, self.workers)
        self.pool = JitPool(self.tasks, self.device, workers, progress, first=[t for t in self.tasks if t[0] in first],
                            grouped=grouped).start()

    @contextlib.contextmanager
    def beside_pool(self):
        """While the activation profile runs beside the pool: its custom ops see the pool's registry
        (`building()`), so a dense class still building runs on the Triton GEMM and a grouped one waits."""
        token = _BESIDE_POOL.set(self.pool.building if self.pool is not None else None)
        try:
            yield
        finally:
            _BESIDE_POOL.reset(token)

    def summary(self) -> str:
        """The start-up log line (`gemm_summary`) for this model's weights and what its profile ran on Triton."""
        deferred = self.pool.building.deferred if self.pool is not None else None
        return gemm_summary([tuple(w.shape) for w, _ in self.weights], deferred, self.grouped)

    def finish_pool(self) -> str:
        """Wait for the pool and stop it; its start-up log detail."""
        if self.pool is None:
            tasks = len(self.tasks) + len(self.grouped)
            return f"all {tasks} GEMM tasks were built before ({os.path.basename(self.manifest)})"
        report = self.pool.join()
        self.pool_failures = report.failures
        if report.failures:
            logger.warning("DeepGEMM JIT: %d failure(s) in the worker processes, the first: %s; the start-up warm-up "
                           "compiles what they left, in this process", len(report.failures), report.failures[0])
        return report.describe()

    def abort_pool(self) -> None:
        if self.pool is not None:
            self.pool.abort()

    def compile_in_pool(self, progress: bool = True) -> str:
        """`start_pool` and `finish_pool`, with nothing beside them."""
        self.start_pool(progress=progress)
        return self.finish_pool()

    def _grouped_left(self) -> list[GroupedRows]:
        """The grouped ranges no worker built (none when the manifest says every task was built before)."""
        if self.pool is None:
            return []
        unbuilt = self.pool.unbuilt
        return [t for t in self.grouped if t not in self.pool.grouped or t in unbuilt]

    def load(self) -> str:
        before = cached_kernels()
        failures = len(self.library.failures)
        start = time.perf_counter()
        calls = warm_up_fp8_gemms(self.library, self.weights, self.max_rows)
        grouped_failed, grouped_run = [], 0
        for task in self._grouped_left():
            weight, scale = self.expert_weights[(task.groups, task.n, task.k)]
            for rows, error in run_grouped_rows(self.library.module, task, self.device, weight, scale):
                grouped_run += 1
                if error:
                    grouped_failed.append(f"{_describe(task)}, {rows} rows: {error}")
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        compiled = len(cached_kernels() - before)
        failed = self.library.failures[failures:]
        if calls == len(self.tasks) and not failed and not grouped_failed:
            write_manifest(self.manifest)
        text = (f"{calls} of {len(self.tasks)} GEMM classes"
                f"{f' and {grouped_run} grouped-GEMM row counts' if grouped_run else ''} run in "
                f"{time.perf_counter() - start:.1f} s, {compiled} kernels compiled in this process")
        if failed:
            text += f"; DeepGEMM's GEMM failed ({failed[0]}): Triton serves each call it fails"
        if grouped_failed:
            logger.error("DeepGEMM's grouped GEMM failed at %d row counts, the first: %s; the Triton fused MoE serves "
                         "each call it fails", len(grouped_failed), grouped_failed[0])
            text += f"; the grouped GEMM failed at {len(grouped_failed)} row counts"
        logger.info("%s", self.summary())  # the one line on which shapes DeepGEMM serves and which Triton does
        return text


def run_grouped_rows(module, task: GroupedRows, device: torch.device, weight: torch.Tensor | None = None,
                     scale: torch.Tensor | None = None) -> Iterator[tuple[int, str | None]]:
    """Run the contiguous grouped GEMM once at each of `task`'s row counts, largest first, the way serving calls it
    (`deepgemm.run_grouped_gemm`), so DeepGEMM compiles (or loads) each kernel it picks; yields (rows, None or the
    error). Every row is padding (-1): DeepGEMM multiplies nothing, and its loads of a padding block read expert 0's
    weight, so neither the rows' contents nor the weight's matter. `weight` / `scale`: the expert weight [groups,
    N, K] and its scales (made here when not given: a worker process)."""
    from minidsa.kernels.fp8 import FP8_DTYPE
    from minidsa.kernels.fp8_gemm import mn_major_scales

    grouped = deepgemm.grouped_contiguous(module)
    rows = [c[0] for c in task.classes()]
    if grouped is None:
        for m in rows:
            yield m, "this DeepGEMM build has no contiguous grouped FP8 GEMM"
        return
    gemm, _ = grouped
    if weight is None:
        weight = torch.empty(task.groups, task.n, task.k, dtype=FP8_DTYPE, device=device)
        scale = torch.ones(task.groups, -(-task.n // 128), -(-task.k // 128), dtype=torch.float32, device=device)
    a = torch.empty(task.last, task.k, dtype=FP8_DTYPE, device=device)
    out = torch.empty(task.last, task.n, dtype=torch.bfloat16, device=device)
    m_indices = torch.full((task.last,), -1, dtype=torch.int32, device=device)
    try:
        for m in rows:
            try:
                deepgemm.run_grouped_gemm(gemm, a[:m], mn_major_scales(m, task.k // 128, device), weight, scale,
                                          out[:m], m_indices[:m])
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
            except Exception as e:  # noqa: BLE001 - reported per row count; serving falls back to Triton for it
                yield m, f"{type(e).__name__}: {e}"
            else:
                yield m, None
    finally:
        del weight, scale, a, out, m_indices
        if device.type == "cuda":
            torch.cuda.empty_cache()  # another worker's task, or the KV cache, gets the memory back


# ---------------------------------------------------------------- the worker process

def _run_worker(device_name: str) -> int:
    """Read tasks from stdin, one JSON line each, run each, and answer one JSON line per class: `{"dense": [rows,
    n, k]}` (one class) or `{"grouped": GroupedRows}` (a class per row count, `run_grouped_rows`).

    DeepGEMM prints with C's printf: this process's stdout is moved to stderr first, so replies travel on a
    descriptor of their own."""
    replies = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    try:
        import deep_gemm

        from minidsa.kernels.fp8 import FP8_DTYPE

        device = torch.device(device_name)
        if device.type == "cuda":
            torch.cuda.set_device(device)
    except Exception as e:  # noqa: BLE001 - reported to the engine, which goes on without the pool
        replies.write(json.dumps({"ready": False, "error": f"{type(e).__name__}: {e}"}) + "\n")
        return 1
    replies.write(json.dumps({"ready": True}) + "\n")
    shape, weight, scale, x = None, None, None, None
    for line in sys.stdin:
        task = json.loads(line)
        if "grouped" in task:
            weight = scale = x = shape = None  # the grouped task's tensors are large: nothing else beside them
            if device.type == "cuda":
                torch.cuda.empty_cache()
            for _, error in run_grouped_rows(deep_gemm, GroupedRows(*task["grouped"]), device):
                replies.write(json.dumps({"ok": error is None, "error": error}) + "\n")
            continue
        rows, n, k = task["dense"]
        try:
            if shape != (n, k):
                weight = scale = x = None  # one shape's tensors at a time
                weight = torch.zeros(n, k, dtype=FP8_DTYPE, device=device)
                scale = torch.ones(-(-n // 128), -(-k // 128), dtype=torch.float32, device=device)
                shape = (n, k)
            if x is None or x.shape[0] < rows:
                x = torch.zeros(rows, k, dtype=torch.bfloat16, device=device)
            deepgemm.run_fp8_gemm(deep_gemm, x[:rows], weight, scale)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            replies.write(json.dumps({"ok": True}) + "\n")
        except Exception as e:  # noqa: BLE001 - one class failed; the engine's warm-up meets it again
            replies.write(json.dumps({"ok": False, "error": f"{type(e).__name__}: {e}"}) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(_run_worker(sys.argv[1]))
