"""DeepGEMM's start-up warm-up (minidsa/kernels/deepgemm_warmup.py): its GEMM kernels compiled by a pool of
processes, the registry of what the pool is still building, the one start-up log line.

No DeepGEMM build runs here: `tests/deep_gemm_stand_in/deep_gemm.py` stands in for it, in this process and in
the worker processes (through PYTHONPATH), with a JIT disk cache of its own kind (kernels shared by several
classes, compiled into `$DG_JIT_CACHE_DIR/cache` when missing) and a log of every call: which process ran
which (rows, N, K) class, and whether it compiled or loaded its kernel. The activation quantisation before each
call is a Triton kernel, run by Triton's interpreter as in tests/test_kernels.py.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import os
import sys

import pytest
import torch

if torch.cuda.is_available():
    pytest.skip("CUDA present: the GPU check runs the pool on the real DeepGEMM (benchmarks/scripts/startup.py)",
                allow_module_level=True)

from triton_interp import import_kernels_interpreted  # noqa: E402

if not import_kernels_interpreted():
    pytest.skip("triton was imported compiled in this process: run this file alone", allow_module_level=True)

from minidsa.kernels import deepgemm, fp8, optional_lib  # noqa: E402
from minidsa.config import DEEPGEMM_WORKERS_ENV, ConfigError, EngineConfig, resolve  # noqa: E402
from minidsa.kernels import deepgemm_warmup  # noqa: E402
from minidsa.kernels.deepgemm_warmup import GemmWarmUp, JitPool, spread, worker_count  # noqa: E402
from minidsa.kernels.deepgemm_warmup import gemm_summary, gemm_tasks, grouped_tasks  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STAND_IN_DIR = os.path.join(ROOT, "tests", "deep_gemm_stand_in")
CPU = torch.device("cpu")
MAX_ROWS = 160  # 9 row classes per weight shape (17 rows and up: small weights)


class StandIn:
    def __init__(self, log: str, library: deepgemm.DeepGEMM):
        self.log = log
        self.seen = 0
        self.library = library  # the engine's handle on it

    def events(self) -> list[dict]:
        """The calls logged since the last look."""
        try:
            with open(self.log) as f:
                lines = f.read().splitlines()
        except FileNotFoundError:
            lines = []
        new, self.seen = lines[self.seen:], len(lines)
        return [json.loads(line) for line in new]


@pytest.fixture
def stand_in(monkeypatch, tmp_path):
    monkeypatch.setenv("DG_JIT_CACHE_DIR", str(tmp_path / "dg"))
    monkeypatch.setenv("STAND_IN_DG_LOG", str(tmp_path / "calls.jsonl"))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([STAND_IN_DIR, ROOT, os.environ.get("PYTHONPATH", "")]))
    monkeypatch.delenv("STAND_IN_DG_CRASH_WORKER", raising=False)
    spec = importlib.util.spec_from_file_location("deep_gemm", os.path.join(STAND_IN_DIR, "deep_gemm.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    monkeypatch.setitem(sys.modules, "deep_gemm", mod)
    monkeypatch.setattr(optional_lib, "cuda_capability", lambda device: (9, 0))
    module, status = deepgemm.probe(CPU, deepgemm.GEMM_API)
    assert status.available
    return StandIn(str(tmp_path / "calls.jsonl"), deepgemm.DeepGEMM(module, status, CPU))


def _weights() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    w1, s1 = fp8.quant_block(torch.randn(192, 256, generator=g))
    w2, s2 = fp8.quant_block(torch.randn(128, 128, generator=g))
    return [(w1, s1), (w2, s2), (w1.clone(), s1.clone())]  # the third shares the first one's shape


def _tasks(events: list[dict]) -> list[tuple[int, int, int]]:
    return sorted(tuple(e["task"]) for e in events)


def test_queue_order_interleaves_shapes_and_spreads_row_classes():
    tasks = gemm_tasks([(192, 256), (128, 128), (4096, 7168)], 8192)
    order = spread(tasks)
    assert sorted(order) == sorted(tasks)  # every class, once
    shapes = [t[1:] for t in order]
    assert len(set(shapes[:3])) == 3  # the first tasks are of three different shapes
    lane = [t[0] for t in tasks if t[1:] == (4096, 7168)]
    first = [lane.index(t[0]) for t in order if t[1:] == (4096, 7168)][:4]
    assert first == [0, 32, 16, 48]  # a shape's classes far apart first (bit-reversed), then the gaps halve


def test_worker_count_follows_the_cpus_and_the_environment(monkeypatch):
    tasks = gemm_tasks([(192, 256)], MAX_ROWS)
    cpus = len(os.sched_getaffinity(0))
    assert worker_count(tasks, CPU) == min(cpus, len(tasks))
    assert worker_count(tasks, CPU, share=cpus) == 1  # the CPUs are split among tensor-parallel ranks
    assert worker_count(tasks, CPU, workers=5) == 5
    # the environment is read once, by the configuration's resolution
    monkeypatch.delenv(DEEPGEMM_WORKERS_ENV, raising=False)
    assert resolve(EngineConfig()).deepgemm_jit_workers is None
    monkeypatch.setenv(DEEPGEMM_WORKERS_ENV, "5")
    assert resolve(EngineConfig()).deepgemm_jit_workers == 5
    monkeypatch.setenv(DEEPGEMM_WORKERS_ENV, "five")
    with pytest.raises(ConfigError, match=DEEPGEMM_WORKERS_ENV):
        resolve(EngineConfig())


def test_pool_runs_every_class_once_and_the_warm_up_compiles_nothing(stand_in, monkeypatch):
    jit = GemmWarmUp(_weights(), MAX_ROWS, CPU, stand_in.library, workers=3)
    assert len(jit.tasks) == len(set(jit.tasks)) and {t[1:] for t in jit.tasks} == {(192, 256), (128, 128)}
    detail = jit.compile_in_pool(progress=False)
    pool = stand_in.events()
    assert all(e["worker"] and e["pid"] != os.getpid() for e in pool)
    assert _tasks(pool) == sorted(jit.tasks)  # every class of every shape, exactly once across the pool
    compiled = {e["kernel"] for e in pool if e["event"] == "compiled"}
    assert f"{len(jit.tasks)} GEMM classes on 3 processes" in detail
    assert f"{len(compiled)} kernels compiled, 0 were in the cache" in detail and not jit.pool_failures

    detail = jit.load()  # the engine's warm-up: every class in this process, every kernel from the disk cache
    here = stand_in.events()
    assert _tasks(here) == sorted(jit.tasks) and {e["event"] for e in here} == {"loaded"}
    assert all(not e["worker"] and e["pid"] == os.getpid() for e in here)
    assert "0 kernels compiled in this process" in detail and not stand_in.library.failures

    again = GemmWarmUp(_weights(), MAX_ROWS, CPU, stand_in.library)  # the next start finds the manifest: no pool
    assert "were built before" in again.compile_in_pool(progress=False) and stand_in.events() == []
    # served calls run the classes compiled at start-up, with DeepGEMM's result
    w8, ws = _weights()[0]
    x = torch.randn(100, 256).bfloat16()
    torch.testing.assert_close(deepgemm.fp8_gemm_nt(stand_in.library.module, x, w8, ws).float(),
                               fp8.w8a8_block_matmul_reference(x.float(), w8, ws), rtol=2e-2, atol=2e-2)


def test_a_worker_that_dies_is_reported_and_the_warm_up_compiles_what_it_left(stand_in, monkeypatch, caplog):
    monkeypatch.setenv("STAND_IN_DG_CRASH_WORKER", "48")  # a worker process exits on any 48-row class
    jit = GemmWarmUp(_weights(), MAX_ROWS, CPU, stand_in.library, workers=2)
    with caplog.at_level(logging.WARNING, logger="minidsa.kernels.deepgemm_warmup"):
        detail = jit.compile_in_pool(progress=False)
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "died on 48x" in warnings[0] and "exit code 3" in warnings[0], warnings
    assert "failed" in detail
    pool = stand_in.events()
    assert len(_tasks(pool)) == len(set(_tasks(pool))) and all(t[0] != 48 for t in _tasks(pool))

    detail = jit.load()  # the engine still starts: this process compiles exactly the kernels the pool did not
    here = stand_in.events()
    assert _tasks(here) == sorted(jit.tasks)
    needed = {e["kernel"] for e in here}
    from_pool = {e["kernel"] for e in pool if e["event"] == "compiled"}
    assert {e["kernel"] for e in here if e["event"] == "compiled"} == needed - from_pool
    assert f"{len(needed - from_pool)} kernels compiled in this process" in detail
    assert not stand_in.library.failures  # DeepGEMM still serves


def test_workers_that_cannot_start_leave_everything_to_the_warm_up(stand_in, monkeypatch, caplog):
    monkeypatch.setenv("PYTHONPATH", ROOT)  # no deep_gemm in the workers
    jit = GemmWarmUp(_weights(), MAX_ROWS, CPU, stand_in.library, workers=2)
    with caplog.at_level(logging.WARNING, logger="minidsa.kernels.deepgemm_warmup"):
        jit.compile_in_pool(progress=False)
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "failed to start" in warnings[0] and "deep_gemm" in warnings[0], warnings
    assert any("classes were not run" in f for f in jit.pool_failures)
    assert stand_in.events() == []
    jit.load()
    here = stand_in.events()
    assert _tasks(here) == sorted(jit.tasks) and "compiled" in {e["event"] for e in here}


class _NotToBeCalled:
    """A DeepGEMM module that fails any use: the class asked for is one the pool is still building."""

    def __getattr__(self, name):
        raise AssertionError(f"deep_gemm.{name} used for a class the pool is building")


def test_classes_the_pool_is_building_go_to_triton_in_this_process(stand_in, monkeypatch, caplog):
    """The activation profile runs beside the pool without waiting for it: until the pool has built a class, the
    fp8_linear op runs it on the Triton GEMM in this process (DeepGEMM is not asked, nothing is compiled here, no
    warning: the call is counted for the start-up line). Only inside `beside_pool`: the registry is the pool's,
    not the process's. The profile's classes are dealt out first, and the pool runs every class exactly once."""
    from minidsa.kernels import custom_ops, fp8_gemm  # noqa: F401  (registers torch.ops.minidsa.fp8_linear)

    jit = GemmWarmUp(_weights(), MAX_ROWS, CPU, stand_in.library, workers=2)
    w, s = _weights()[0]
    x = torch.randn(100, 256).to(torch.bfloat16)
    want = fp8_gemm.w8a8_block_gemm(x, w, s)
    assert deepgemm_warmup.building() is None
    assert deepgemm.fp8_gemm_nt(stand_in.library.module, x, w, s) is not None  # no pool: DeepGEMM serves it
    stand_in.events()  # (that call, logged)
    jit.start_pool(first_rows=[100], progress=False)  # a 100-token step: the 112-row class of each shape
    first = sorted(t for t in jit.tasks if t[0] == deepgemm.gemm_rows(100))
    assert len(first) == 2 and (112, 192, 256) in first
    assert set(jit.pool.building._classes) == set(jit.tasks)  # the workers are still starting: nothing is built
    monkeypatch.setitem(sys.modules, "deep_gemm", _NotToBeCalled())
    with caplog.at_level(logging.DEBUG), jit.beside_pool():
        assert deepgemm_warmup.building() is jit.pool.building
        for _ in range(2):
            assert torch.equal(torch.ops.minidsa.fp8_linear(x, w, s, True), want)
    assert deepgemm_warmup.building() is None  # outside the profile: serving never consults it
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert jit.pool.building.deferred == {(112, 192, 256): 2}
    detail = jit.finish_pool()
    assert not jit.pool.building
    assert f"{len(jit.tasks)} GEMM classes on 2 processes" in detail and not jit.pool_failures
    assert sorted(_tasks(stand_in.events())) == sorted(jit.tasks)  # every class once, all in the workers
    assert deepgemm.fp8_gemm_nt(stand_in.library.module, x, w, s) is not None
    assert "activation profile ran 1 GEMM class on Triton while the JIT pool was still building them (rows x N x " \
        "K: 112x192x256" in jit.summary()
    # dealt out first (the log's order is the workers', which start at different times: the queue's is checked)
    queue = list(JitPool(jit.tasks, CPU, 2, progress=False, first=first)._pending)
    assert set(queue[:2]) == set(first) and sorted(queue) == sorted(jit.tasks)


def test_a_failed_start_up_stops_the_pool(stand_in):
    jit = GemmWarmUp(_weights(), MAX_ROWS, CPU, stand_in.library, workers=2)
    jit.start_pool(progress=False)
    procs = [w.proc for w in jit.pool._workers]
    jit.abort_pool()
    assert all(p.poll() is not None for p in procs)  # the compile processes are gone
    assert not jit.pool.building  # the classes it left are DeepGEMM's again (compiled where they run)
    ran = _tasks(stand_in.events())
    assert len(ran) < len(jit.tasks) and len(ran) == len(set(ran))


def test_the_manifest_is_per_jit_compiler(monkeypatch):
    """Kernels built by NVRTC are not those nvcc builds (DeepGEMM names them by compiler and flags): a start with
    another compiler setting must not take the other one's manifest as its own."""
    from minidsa.kernels.deepgemm_warmup import manifest_path

    tasks = gemm_tasks([(192, 256)], MAX_ROWS)
    monkeypatch.delenv("DG_JIT_USE_NVRTC", raising=False)
    nvcc = manifest_path(tasks, CPU)
    monkeypatch.setenv("DG_JIT_USE_NVRTC", "1")
    assert manifest_path(tasks, CPU) != nvcc
    here = os.path.basename(manifest_path(tasks, CPU))
    monkeypatch.setenv("DG_JIT_CACHE_DIR", "/elsewhere")  # where the cache lives is not what it holds
    assert os.path.basename(manifest_path(tasks, CPU)) == here


# ---------------------------------------------------------------- the routed experts' grouped GEMM
EXPERTS, TOP_K, HIDDEN, INTER = 4, 2, 128, 128
GROUPED_MAX_TOKENS = 288  # the grouped GEMM serves from 256 tokens (128 pairs per expert): 256-288 tokens


def _experts():
    g = torch.Generator().manual_seed(1)
    gate_up = fp8.quant_block(torch.randn(EXPERTS, 2 * INTER, HIDDEN, generator=g) * HIDDEN**-0.5)
    down = fp8.quant_block(torch.randn(EXPERTS, HIDDEN, INTER, generator=g) * INTER**-0.5)
    return [(gate_up, down, TOP_K, True)]


def _routed(num_tokens: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, HIDDEN, generator=g).bfloat16()
    ids = torch.rand(num_tokens, EXPERTS, generator=g).topk(TOP_K, dim=1).indices.to(torch.int32)
    weights = torch.rand(num_tokens, TOP_K, generator=g)
    return x, ids, weights / weights.sum(1, keepdim=True)


def _moe(module, x, ids, weights, building=None):
    (gu, gu_s), (dn, dn_s), _, _ = _experts()[0]
    got = deepgemm.moe_contiguous(module, x, ids, weights, gu, dn, gu_s, dn_s, building=building)
    from minidsa.kernels.fused_moe import fused_moe_reference

    want = fused_moe_reference(x.float(), ids.long(), weights, gu, dn, gu_s, dn_s)
    return got, want


def _grouped(events: list[dict]) -> list[tuple[int, ...]]:
    return sorted(tuple(e["task"]) for e in events if len(e["task"]) == 4)


def test_grouped_rows_are_every_row_count_a_step_can_bring():
    """The pool runs the grouped GEMM at every row count `moe_contiguous` can hand it: each expert's pairs padded to
    the alignment, for any routing of any step it serves; below that size the Triton fused MoE serves."""
    from minidsa.kernels.moe_layout import max_padded_rows

    shape = (EXPERTS, 2 * INTER, HIDDEN)
    [gate_up, down] = grouped_tasks([(shape, TOP_K, True)], 16, GROUPED_MAX_TOKENS)
    assert (gate_up.n, gate_up.k, down.n, down.k) == (2 * INTER, HIDDEN, HIDDEN, INTER)
    assert (gate_up.first, gate_up.last, gate_up.step) == (512, max_padded_rows(576, EXPERTS, 16), 16)
    g = torch.Generator().manual_seed(0)
    seen = set()
    for _ in range(300):
        tokens = int(torch.randint(256, GROUPED_MAX_TOKENS + 1, (1,), generator=g))
        skewed = torch.rand(EXPERTS, generator=g) ** 4  # routings from even to all-on-a-few
        counts = torch.bincount(torch.multinomial(skewed.expand(tokens, -1), TOP_K, generator=g).flatten(),
                                minlength=EXPERTS)
        rows = int((-(-counts // 16) * 16).sum())
        seen.add(rows)
        assert (rows, 2 * INTER, HIDDEN, EXPERTS) in gate_up.classes()
        assert (rows, HIDDEN, INTER, EXPERTS) in down.classes()
    assert len(seen) > 3
    # under expert parallelism a rank's share of the pairs can be any size; a step cut into chunks can end short
    assert grouped_tasks([(shape, TOP_K, False)], 16, GROUPED_MAX_TOKENS)[0].first == 16
    assert grouped_tasks([(shape, TOP_K, True)], 16, deepgemm.MOE_MAX_CHUNK_TOKENS + 1)[0].first == 16
    assert grouped_tasks([(shape, TOP_K, True)], 16, 255) == []  # no step the grouped GEMM takes


def test_the_pool_builds_every_grouped_row_count_once_and_serving_compiles_none(stand_in):
    jit = GemmWarmUp([], GROUPED_MAX_TOKENS, CPU, stand_in.library, workers=2, experts=_experts())
    classes = sorted(c for t in jit.grouped for c in t.classes())
    assert len(jit.grouped) == 2 and len(classes) == 18
    detail = jit.compile_in_pool(progress=False)
    pool = stand_in.events()
    assert all(e["worker"] for e in pool) and _grouped(pool) == classes  # each row count once, in the workers
    compiled = [e["kernel"] for e in pool if e["event"] == "compiled"]
    assert len(compiled) == len(set(compiled)) == 2  # a range's row counts share its kernel: compiled once
    assert "18 grouped-GEMM row counts on 2 processes" in detail and not jit.pool_failures
    assert "0 kernels compiled in this process" in jit.load() and stand_in.events() == []  # nothing left to run
    x, ids, weights = _routed(270, seed=3)
    got, want = _moe(stand_in.library.module, x, ids, weights)
    served = stand_in.events()
    assert {e["event"] for e in served} == {"loaded"} and set(_grouped(served)) <= set(classes)
    assert ((got.float() - want).norm() / want.norm()).item() < 3e-2


def test_the_profile_waits_for_its_grouped_row_count_and_compiles_nothing(stand_in):
    """The activation profile runs beside the pool. Its MoE waits for the worker building its row count (the
    Triton fused MoE would not have the grouped GEMM's peak), then loads the kernel that worker compiled."""
    jit = GemmWarmUp([], GROUPED_MAX_TOKENS, CPU, stand_in.library, workers=2, experts=_experts())
    jit.start_pool(progress=False)
    assert {c for t in jit.grouped for c in t.classes()} <= set(jit.pool.building._classes)
    x, ids, weights = _routed(GROUPED_MAX_TOKENS, seed=4)
    got, want = _moe(stand_in.library.module, x, ids, weights, jit.pool.building)  # waits in here
    jit.finish_pool()
    events = stand_in.events()
    here = [e for e in events if not e["worker"]]
    assert len(here) == 2 and {e["event"] for e in here} == {"loaded"}
    for e in here:  # the worker ran the same class before this process did
        assert any(w["worker"] and w["task"] == e["task"] for w in events[:events.index(e)])
    assert ((got.float() - want).norm() / want.norm()).item() < 3e-2


def test_grouped_rows_a_worker_left_are_run_by_the_warm_up(stand_in, monkeypatch, caplog):
    monkeypatch.setenv("STAND_IN_DG_CRASH_WORKER", "640")  # the largest row count: each worker dies at once
    jit = GemmWarmUp([], GROUPED_MAX_TOKENS, CPU, stand_in.library, workers=2, experts=_experts())
    with caplog.at_level(logging.WARNING, logger="minidsa.kernels.deepgemm_warmup"):
        jit.compile_in_pool(progress=False)
    assert "died on the grouped GEMM" in " ".join(jit.pool_failures) and not jit.pool.building
    assert stand_in.events() == [] and len(jit.pool.unbuilt) == 2
    detail = jit.load()
    here = stand_in.events()
    assert _grouped(here) == sorted(c for t in jit.grouped for c in t.classes()) and not any(e["worker"] for e in here)
    assert "18 grouped-GEMM row counts run" in detail and "2 kernels compiled in this process" in detail


class _Pool:
    """GemmWarmUp's side of `ModelRunner._profile_beside_pool`, recording what the runner asked of it."""

    def __init__(self):
        self.pool, self.calls = None, []

    @contextlib.contextmanager
    def beside_pool(self):
        self.calls.append("beside")
        yield

    def start_pool(self, first_rows, progress):
        self.pool = object()
        self.calls.append(("start", tuple(first_rows)))

    def finish_pool(self):
        self.calls.append("finish")
        return "the rest of the pool"

    def abort_pool(self):
        self.calls.append("abort")


def _profiling_runner(reserve_results):
    """A stand-in with the runner's pieces `_profile_beside_pool` uses; `reserve_results`: what each call of
    `_activation_reserve` raises or returns."""
    from minidsa.exec.startup import StartupPhases

    class Runner:
        device = CPU
        _gemm_jit = _Pool()
        startup = StartupPhases()
        frees: list[int] = []

        def _profile_rows(self):
            return [8192, 64]

        def _compiling_phase(self, name):
            return self.startup.phase(name)

        def _activation_reserve(self, free):
            self.frees.append(free)
            result = reserve_results.pop(0)
            if isinstance(result, BaseException):
                raise result
            return result

    return Runner()


def test_a_profile_out_of_memory_beside_the_pool_runs_again_after_it(monkeypatch):
    from minidsa.exec.runner import ModelRunner

    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (80 << 30, 96 << 30))
    runner = _profiling_runner([torch.cuda.OutOfMemoryError("beside 16 CUDA contexts"), (7 << 30, "7.00 GiB")])
    assert ModelRunner._profile_beside_pool(runner, progress=False) == 7 << 30
    # the profile's steps first (beside the pool), then waited out, then the profile again (the pool is gone)
    assert runner._gemm_jit.calls == [("start", (8192, 64)), "beside", "finish", "beside"]
    assert runner.frees == [80 << 30, 80 << 30]  # both sized against the memory free before the workers started
    assert [(p.name, p.detail) for p in runner.startup.phases] == [
        ("activation profile", ""), ("DeepGEMM JIT", "the rest of the pool"), ("activation profile", "7.00 GiB")]


def test_a_start_up_that_fails_in_the_profile_stops_the_pool(monkeypatch):
    from minidsa.exec.runner import ModelRunner

    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (80 << 30, 96 << 30))
    runner = _profiling_runner([ValueError("a bad shape")])
    with pytest.raises(ValueError, match="a bad shape"):
        ModelRunner._profile_beside_pool(runner, progress=False)
    assert runner._gemm_jit.calls == [("start", (8192, 64)), "beside", "abort"]


def test_grouped_tasks_that_leave_no_memory_for_a_worker_are_run_in_this_process(stand_in, monkeypatch):
    """Where the grouped tasks' tensors (the whole expert weight each) leave no GPU memory for a worker, the pool
    still builds the dense classes, and the warm-up runs the grouped row counts in this process."""
    monkeypatch.setattr(deepgemm_warmup, "worker_count",
                        lambda tasks, device, share=1, workers=None, grouped=(): 0 if grouped else 2)
    jit = GemmWarmUp(_weights(), GROUPED_MAX_TOKENS, CPU, stand_in.library, experts=_experts())
    assert "on 2 processes" in jit.compile_in_pool(progress=False) and not jit.pool_failures
    pool = stand_in.events()
    assert all(e["worker"] for e in pool) and _grouped(pool) == []
    assert sorted(t for t in _tasks(pool) if len(t) == 3) == sorted(jit.tasks)
    detail = jit.load()
    here = stand_in.events()
    assert _grouped(here) == sorted(c for t in jit.grouped for c in t.classes()) and not any(e["worker"] for e in here)
    assert "18 grouped-GEMM row counts run" in detail


# ---------------------------------------------------------------- the start-up log line
def test_start_up_says_once_at_info_which_shapes_deepgemm_serves(stand_in, caplog):
    """One INFO line after the warm-up: the weight shapes DeepGEMM serves (from how many rows), those the Triton
    GEMM serves and why; no per-shape warning, at start-up or when serving. A weight shape it does not take
    (here N 96, K 200) never reaches it, and the op's output is the Triton GEMM's."""
    from minidsa.kernels import custom_ops, fp8_gemm  # noqa: F401  (registers torch.ops.minidsa.fp8_linear)

    g = torch.Generator().manual_seed(2)
    odd_n = fp8.quant_block(torch.randn(96, 256, generator=g))
    odd_k = fp8.quant_block(torch.randn(128, 200, generator=g))
    jit = GemmWarmUp([*_weights(), odd_n, odd_k], MAX_ROWS, CPU, stand_in.library, workers=0)
    assert {t[1:] for t in jit.tasks} == {(192, 256), (128, 128)}
    with caplog.at_level(logging.DEBUG):
        jit.compile_in_pool(progress=False)
        jit.load()
        for w, s in (odd_n, odd_k):
            x = torch.randn(40, w.shape[1], generator=g).bfloat16()
            assert torch.equal(torch.ops.minidsa.fp8_linear(x, w, s, True), fp8_gemm.w8a8_block_gemm(x, w, s))
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text
    said = [r for r in caplog.records if r.getMessage().startswith("DeepGEMM FP8 GEMMs")]
    assert len(said) == 1 and said[0].levelno == logging.INFO
    line = said[0].getMessage()
    assert "DeepGEMM serves 2 FP8 weight shapes (N x K: 192x256, 128x128) from 17 rows" in line
    assert "Triton serves 96x256 (N 96 is not a multiple of 64)" in line
    assert "Triton serves 128x200 (K 200 is not a multiple of 128)" in line
    assert "activation profile" not in line  # no pool ran beside a profile
    assert not [e for e in stand_in.events() if e["task"][1:] in ([96, 256], [128, 200])]


def test_summary_names_the_big_weights_the_grouped_gemm_and_the_profiles_triton_classes():
    line = gemm_summary([(2240, 7168), (7168, 9216), (18432, 7168), (2240, 7168)],
                        {(8192, 2240, 7168): 3, (8192, 7168, 9216): 1},
                        grouped_tasks([((256, 4096, 7168), 8, True)], 128, 8192))
    assert line.count("\n") == 0
    assert "DeepGEMM serves 3 FP8 weight shapes (N x K: 2240x7168, 7168x9216, 18432x7168) from 17 rows" in line
    assert "from 1 row for 18432x7168" in line  # the large weights: DeepGEMM is faster at every size
    assert "grouped GEMM serves the routed experts (256x4096x7168, 256x7168x2048)" in line
    assert "ran 2 GEMM classes on Triton while the JIT pool was still building them (rows x N x K: " \
        "8192x2240x7168, 8192x7168x9216" in line
