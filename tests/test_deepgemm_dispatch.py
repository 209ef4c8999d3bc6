"""Kernel dispatch: DeepGEMM when it imports on SM90/SM100, Triton otherwise, never an error mid-step.

No DeepGEMM build runs here: these tests take the module away (import fails),
hand in incomplete or failing stand-ins, and a stand-in that implements
DeepGEMM's documented contract in torch (including what it leaves undefined:
logits past each row's context are garbage, the schedule must be fresh). The
stand-in is injected as `sys.modules["deep_gemm"]`, and the CPU passes for an
SM90 GPU through `optional_lib.cuda_capability` (both monkeypatched here). The
Triton kernels run through Triton's interpreter, as in tests/test_kernels.py.
"""

from __future__ import annotations

import dataclasses
import logging
import pickle
import sys
import types

import pytest
import torch

if torch.cuda.is_available():
    pytest.skip("CUDA present: tests/gpu/test_kernels_gpu.py checks the compiled kernels", allow_module_level=True)


from triton_interp import import_kernels_interpreted, run_file_interpreted  # noqa: E402

INTERPRETED = import_kernels_interpreted()
in_this_process = pytest.mark.skipif(not INTERPRETED, reason="runs in the child process below")

from harness import compile_without_probing, count_replays, static_fast_paths  # noqa: E402
from minidsa.attention.topk_recording import slots_to_positions  # noqa: E402
from minidsa.attention.backend import DSABackend, bind_ops  # noqa: E402
from minidsa.attention import select  # noqa: E402
from minidsa.attention.select import KernelChoice, load_libraries, select_kernels  # noqa: E402
from minidsa.common.batch import ForwardBatch  # noqa: E402
from minidsa.common.plan import StepKind  # noqa: E402
from minidsa.kernels import deepgemm, deepgemm_warmup, fp8, optional_lib  # noqa: E402
from minidsa.kernels import reference as ref  # noqa: E402
from minidsa.common.kv_cache import IndexerLayout, KVCache, MLALayout, ReqToTokenTable  # noqa: E402
from minidsa.common.kv_cache import slots_of  # noqa: E402
from minidsa.sched.pages import PageAllocator, pages_needed  # noqa: E402


@pytest.mark.skipif(INTERPRETED, reason="kernels are interpreted in this process")
def test_dispatch_in_child_process():
    run_file_interpreted(__file__)


# ---------------------------------------------------------------------------
# a torch stand-in for deep_gemm, following its documented contract
# ---------------------------------------------------------------------------
def dg_schedule(context_lens: torch.Tensor, num_sms: int, split_kv: int = 256) -> torch.Tensor:
    """DeepGEMM's paged schedule, one SM at a time: each row's context is cut into ceil(len / split_kv)
    segments, the total dealt out evenly (the first total % num_sms SMs one more), and SM i's first segment
    named as (row, segment within the row); a start past every segment is (rows, 0)."""
    segments = [-(-int(n) // split_kv) for n in context_lens.reshape(-1)]
    total = sum(segments)
    out = []
    for sm in range(num_sms + 1):
        start = sm * (total // num_sms) + min(sm, total % num_sms)
        row, before = 0, 0
        while row < len(segments) and before + segments[row] <= start:
            before += segments[row]
            row += 1
        out.append([row, start - before if row < len(segments) else 0])
    return torch.tensor(out, dtype=torch.int32)


def make_stand_in(calls: dict, fail: bool = False, drop: str | None = None,
                  schedule_differs: bool = False, fail_first: int = 0) -> types.ModuleType:
    """`schedule_differs`: its metadata marks what it was made for instead (a build whose schedule is not
    the one minidsa computes); its kernel then checks that marker. `fail`: its paged kernel always raises;
    `fail_first`: its first `fail_first` calls raise."""
    mod = types.ModuleType("deep_gemm")
    mod.__version__ = "stand-in"

    def get_paged_mqa_logits_metadata(context_lens, block_kv, num_sms):
        assert context_lens.dim() == 2 and context_lens.shape[1] == 1, "context lengths must be (N, 1)"
        assert context_lens.dtype == torch.int32 and context_lens.is_contiguous()
        calls["schedule"] = calls.get("schedule", 0) + 1
        if not schedule_differs:
            return dg_schedule(context_lens, num_sms)
        meta = torch.zeros(num_sms + 1, 2, dtype=torch.int32)
        meta[0] = torch.stack([context_lens.sum(), torch.tensor(block_kv)])  # what it was made for
        return meta

    def fp8_paged_mqa_logits(q, kv_cache, weights, context_lens, block_table, schedule_meta, max_context_len,
                             clean_logits):
        calls["paged"] = calls.get("paged", 0) + 1
        calls.setdefault("context_lens", []).append(context_lens.clone())
        if fail or calls["paged"] <= fail_first:
            raise RuntimeError("stand-in: DG_HOST_ASSERT failed")
        num_q, next_n, heads, d = q.shape
        num_pages, block_kv = kv_cache.shape[:2]
        assert next_n == 1 and q.dtype == torch.float8_e4m3fn and weights.shape == (num_q, heads)
        assert kv_cache.dtype == torch.uint8 and kv_cache.shape[2:] == (1, d + 4)
        assert context_lens.shape == (num_q, 1) and block_table.dtype == torch.int32
        if schedule_differs:
            assert int(schedule_meta[0, 0]) == int(context_lens.sum()), "stale schedule"
        else:
            assert torch.equal(schedule_meta, dg_schedule(context_lens, schedule_meta.shape[0] - 1)), "stale schedule"
        keys, scales = ref.fp8_views(kv_cache.reshape(num_pages, -1), block_kv, d)
        aligned = -(-max_context_len // 256) * 256
        out = torch.full((num_q, aligned), float("nan"))  # undefined past the context
        for b in range(num_q):
            n_blocks = -(-int(context_lens[b, 0]) // block_kv)
            pages = block_table[b, :n_blocks].long()
            k = keys[pages].reshape(-1, d).float() * scales[pages].reshape(-1, 1)
            # Whole blocks, as the kernel does: the tail of the last block scores whatever keys sit there.
            out[b, : n_blocks * block_kv] = weights[b] @ (q[b, 0].float() @ k.T).relu()
        return out[:, :max_context_len]

    def fp8_mqa_logits(q, kv, weights, ks, ke, clean_logits):
        calls["ragged"] = calls.get("ragged", 0) + 1
        k8, k_scale = kv
        assert q.dtype == k8.dtype == torch.float8_e4m3fn and ks.dtype == ke.dtype == torch.int32
        logits = torch.einsum("sh,shk->sk", weights, (q.float() @ (k8.float() * k_scale[:, None]).T).relu())
        cols = torch.arange(k8.shape[0])
        inside = (cols[None] >= ks[:, None]) & (cols[None] < ke[:, None])
        return logits.masked_fill(~inside, float("-inf") if clean_logits else float("nan"))

    for fn in (get_paged_mqa_logits_metadata, fp8_paged_mqa_logits, fp8_mqa_logits):
        if fn.__name__ != drop:
            setattr(mod, fn.__name__, fn)
    return mod


@pytest.fixture
def sm90(monkeypatch, fresh_log_once):
    """Pretend the CPU is an SM90 GPU for the libraries' probes; every fallback message is logged afresh."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # triton re-reads it in imports it makes lazily
    monkeypatch.setattr(optional_lib, "cuda_capability", lambda device: (9, 0))
    # DeepGEMM serves every shape it can take (the measured table routes some shapes to Triton on a real GPU).
    monkeypatch.setattr(deepgemm, "DEEPGEMM_PAGED_WINS", ((0, 1 << 30, 0, 1 << 30),))
    monkeypatch.setattr(deepgemm, "DEEPGEMM_RAGGED_WINS", True)


def _with_module(monkeypatch, mod):
    monkeypatch.setitem(sys.modules, "deep_gemm", mod)  # None makes `import deep_gemm` raise ImportError


def choose(**kw) -> KernelChoice:
    """The Triton / DeepGEMM / FlashMLA choice on the CPU (under the interpreter, as on a GPU)."""
    return select_kernels("cpu", kernel_backend="triton", **kw)


def ops_for(choice: KernelChoice, page_size: int = 64):
    """The ops a DSABackend of an engine with `choice` binds (its libraries loaded as an engine loads them)."""
    return bind_ops(choice, load_libraries(choice, "cpu"), page_size)


# ---------------------------------------------------------------------------
# choosing
# ---------------------------------------------------------------------------
@in_this_process
def test_router_kernel_is_chosen_by_the_models_routing(caplog):
    """The one-launch router where Triton runs and the experts and groups are powers of two; the reference
    otherwise, with the reason in the start-up log; the references everywhere with kernel_backend="torch"."""
    from minidsa.attention.select import RouterShape
    assert choose(router=RouterShape(256, 8)).router == "triton"  # DeepSeek-V3.2
    assert choose(router=RouterShape(256, 1)).router == "triton"  # GLM-5
    with caplog.at_level(logging.INFO):
        assert choose(router=RouterShape(96, 4)).router == "torch"
    assert "MoE router: torch reference (the Triton router needs power-of-two" in caplog.text
    assert select_kernels("cpu", kernel_backend="torch", router=RouterShape(256, 8)).router == "torch"


@in_this_process
def test_missing_deep_gemm_falls_back_to_triton_and_says_so(sm90, monkeypatch, caplog):
    _with_module(monkeypatch, None)
    with caplog.at_level(logging.INFO):
        choice = select_kernels(torch.device("cpu"), kernel_backend="triton")
    assert choice.index_logits == "triton"
    assert choice.store_index_k == choice.sparse_mla == choice.kv_move == "triton"
    assert "import deep_gemm failed" in caplog.text
    assert "DSA indexer logits: Triton (import deep_gemm failed" in caplog.text  # one line per decision
    assert "Kernel choice:" in caplog.text and "index_logits=triton" in caplog.text


@in_this_process
@pytest.mark.parametrize("missing", ["fp8_mqa_logits", "get_paged_mqa_logits_metadata"])
def test_incomplete_deep_gemm_is_rejected_at_start_up(sm90, monkeypatch, caplog, missing):
    _with_module(monkeypatch, make_stand_in({}, drop=missing))
    with caplog.at_level(logging.INFO):
        choice = choose()
    assert choice.index_logits == "triton"
    assert f"deep_gemm lacks {missing}" in caplog.text


@in_this_process
def test_wrong_gpu_generation_and_opt_out(sm90, monkeypatch):
    _with_module(monkeypatch, make_stand_in({}))
    assert choose(use_deep_gemm=False).index_logits == "triton"
    monkeypatch.setattr(optional_lib, "cuda_capability", lambda device: (8, 0))
    module, status = deepgemm.probe(torch.device("cpu"))
    assert module is None and not status.available and "SM80" in status.reason
    assert choose().index_logits == "triton"


@in_this_process
def test_stand_in_deep_gemm_is_chosen(sm90, monkeypatch):
    _with_module(monkeypatch, make_stand_in({}))
    assert choose().index_logits == "deepgemm"
    assert deepgemm.probe(torch.device("cpu"))[1].reason == "deep_gemm stand-in on SM90"


@in_this_process
def test_choice_is_plain_picklable_and_logged_one_line_per_decision(sm90, monkeypatch, caplog):
    _with_module(monkeypatch, make_stand_in({}))
    with caplog.at_level(logging.INFO, logger="minidsa.attention.select"):
        choice = choose()
    assert pickle.loads(pickle.dumps(choice)) == choice  # what the config carries to tensor-parallel ranks
    lines = [r.getMessage() for r in caplog.records if r.name == "minidsa.attention.select"]
    for label in select.LABELS.values():  # every kernel named once, with what serves it and why
        assert sum(line.startswith(label) or f", {label}" in line for line in lines) == 1, (label, lines)
    assert "DSA indexer logits: DeepGEMM where measured faster, else Triton (deep_gemm stand-in on SM90)" in lines
    assert lines[-1] == f"Kernel choice: {choice.describe()}"


@in_this_process
def test_environment_overrides_are_read_by_the_selection(sm90, monkeypatch):
    _with_module(monkeypatch, None)
    for name in ("MINIDSA_TOPK", "MINIDSA_SAMPLE", "MINIDSA_FP8_GEMM"):
        monkeypatch.setenv(name, "torch")
    choice = choose()
    assert (choice.topk, choice.sample, choice.fp8_gemm, choice.index_logits) == ("torch", "torch", "torch", "triton")
    monkeypatch.setenv("MINIDSA_FP8_GEMM", "deepgemm")
    with pytest.raises(ValueError, match="MINIDSA_FP8_GEMM=deepgemm: import deep_gemm failed"):
        choose()
    monkeypatch.setenv("MINIDSA_TOPK", "cuda")
    with pytest.raises(ValueError, match="MINIDSA_TOPK must be"):
        choose()
    assert select_kernels("cpu", kernel_backend="torch") == KernelChoice()  # the references, whatever it says


@in_this_process
def test_each_rank_loads_the_libraries_its_choice_names(sm90, monkeypatch):
    calls: dict = {}
    _with_module(monkeypatch, make_stand_in(calls))
    choice = choose()
    libraries = load_libraries(choice, "cpu")
    assert libraries.deepgemm.module is sys.modules["deep_gemm"] and libraries.deepgemm.own_schedule(64)
    assert libraries.deepgemm.status.sm_major == 9 and calls["schedule"] == 2  # the schedule check, once
    assert load_libraries(choose(use_deep_gemm=False), "cpu").deepgemm is None
    _with_module(monkeypatch, None)  # a rank where it does not import: a clear error, not a silent Triton engine
    with pytest.raises(RuntimeError, match="names DeepGEMM, but on cpu: import deep_gemm failed"):
        load_libraries(choice, "cpu")
    with pytest.raises(ValueError, match="needs the DeepGEMM handle"):
        bind_ops(choice)


def test_context_lens_helper_shape():
    lens = torch.tensor([5, 9, 1], dtype=torch.int64)
    out = deepgemm.context_lens_2d(lens)
    assert out.shape == (3, 1) and out.dtype == torch.int32 and out.is_contiguous()
    assert out.flatten().tolist() == [5, 9, 1]


def test_topk_crossover_rule():
    from minidsa.kernels.topk import triton_wins

    cpu = torch.device("cpu")  # 8 "SMs" off CUDA
    assert triton_wins(8, 32768, cpu)  # one wave of 32k rows: the radix select
    assert triton_wins(16, 32768, cpu)
    assert triton_wins(1, 131072, cpu)  # one long row: split over programs
    assert not triton_wins(2, 131072, cpu)  # rows > SMs / 8, one 128k row per program: torch.topk
    assert not triton_wins(24, 32768, cpu)  # three waves of rows here


@in_this_process
def test_shapes_the_triton_kernels_cannot_take_use_the_reference(sm90, caplog):
    ops = bind_ops(KernelChoice("triton", "triton", "triton", "triton", "triton"))
    g = torch.Generator().manual_seed(3)
    q = torch.randn(3, 4, 24 + 16, generator=g)  # v_dim 24: not a power of two
    cache = torch.randn(50, 40, generator=g)
    idx = torch.randint(0, 50, (3, 10), generator=g, dtype=torch.int32)
    with caplog.at_level(logging.WARNING):
        got = ops.sparse_mla(q, cache, idx, 0.2, 24)
    torch.testing.assert_close(got, ref.sparse_mla(q, cache, idx, 0.2, 24))
    assert "latent 24 + rope 16" in caplog.text


@in_this_process
def test_query_quantisation_runs_the_triton_op_where_chosen(sm90, monkeypatch, caplog):
    """The fp8 indexer's query rotation + e4m3 is the one-launch op where Triton serves the DSA kernels, the
    reference with kernel_backend="torch"; `index_topk` quantises through what was bound, with the backend's
    Hadamard matrix. Inside the op, a head dim the kernel cannot take runs the reference."""
    _with_module(monkeypatch, None)
    choice = choose()
    assert choice.quant_index_q == "triton"
    assert ops_for(choice).quant_index_q is torch.ops.minidsa.quant_index_q
    torch_choice = select_kernels("cpu", kernel_backend="torch")
    assert torch_choice.quant_index_q == "torch" and bind_ops(torch_choice).quant_index_q is ref.quant_index_q

    be, table = _backend(choice, 64)
    bound, seen = be.ops.quant_index_q, []

    def recording(q, weights, hadamard, cos, sin, rope_interleave):
        seen.append((hadamard, cos, sin, rope_interleave))
        return bound(q, weights, hadamard, cos, sin, rope_interleave)

    monkeypatch.setattr(be, "ops", dataclasses.replace(be.ops, quant_index_q=recording))
    table.write(0, 0, torch.arange(64, 64 + 40))
    batch = ForwardBatch.build(StepKind.DECODE, [0], [0], [39], [1], torch.tensor([64 + 39]), "cpu")
    g = torch.Generator().manual_seed(4)
    q, w = torch.randn(1, 32, 32, generator=g), torch.rand(1, 32, generator=g)
    cos, sin = torch.randn(1, 8, generator=g), torch.randn(1, 8, generator=g)
    slots = be.index_topk(be.layer_caches[0], batch, q, w, cos, sin, True)
    assert len(seen) == 1 and slots.shape == (1, 24)
    assert seen[0][0] is be.hadamard and seen[0][1] is cos and seen[0][2] is sin and seen[0][3] is True

    q, w = torch.randn(2, 4, 8, generator=g), torch.rand(2, 4, generator=g)
    cos, sin = torch.randn(2, 2, generator=g), torch.randn(2, 2, generator=g)
    with caplog.at_level(logging.WARNING):
        got = torch.ops.minidsa.quant_index_q(q, w, ref.hadamard_matrix(8), cos, sin, False)
    want = ref.quant_index_q(q, w, None, cos, sin, False)
    assert torch.equal(got[0].float(), want[0].float()) and torch.equal(got[1], want[1])
    assert "DSA indexer query quantisation: torch reference (head dim 8" in caplog.text


@pytest.mark.parametrize("interleave", [True, False])
def test_index_topk_rotates_the_queries_for_a_full_precision_cache(interleave):
    """No quantisation to take the query rope in: `index_topk` rotates q itself (`reference.rope_leading`) before
    the logits, so both cache layouts get the same raw q and rope inputs."""
    kv = KVCache(1, 4, MLALayout.for_model(32, 16, torch.float32, "auto"),
                 IndexerLayout(32, torch.float32, False, 64), "cpu")
    table = ReqToTokenTable(2, 256, "cpu")
    be = DSABackend(kv, table.req_to_token, index_topk=8, kernels=KernelChoice())
    g = torch.Generator().manual_seed(6)
    ref.store_index_k(be.layer_caches[0].index_k, torch.arange(40), torch.randn(40, 32, generator=g), 64)
    table.write(0, 0, torch.arange(41))
    batch = ForwardBatch.build(StepKind.DECODE, [0], [0], [40], [1], torch.tensor([40]), "cpu")
    q, w = torch.randn(1, 4, 32, generator=g), torch.rand(1, 4, generator=g)
    angles = torch.rand(1, 8, generator=g) * 100
    cos, sin = angles.cos(), angles.sin()
    got = be.index_topk(be.layer_caches[0], batch, q, w, cos, sin, interleave)
    rotated = ref.rope_leading(q, cos.unsqueeze(1), sin.unsqueeze(1), interleave)
    logits = ref.index_logits(rotated, w, kv.index_k[0], 64, table.req_to_token, batch.token_rows, batch.kv_lens,
                              batch.max_kv_len)
    want, _ = ref.topk_slots(logits, 8, table.req_to_token, batch.token_rows)
    assert torch.equal(got, want)
    unrotated = ref.index_logits(q, w, kv.index_k[0], 64, table.req_to_token, batch.token_rows, batch.kv_lens,
                                 batch.max_kv_len)
    assert not torch.equal(unrotated, logits)


def test_bad_kernel_choice_is_rejected():
    with pytest.raises(ValueError, match="KernelChoice.topk"):
        bind_ops(KernelChoice(topk="cuda"))
    with pytest.raises(ValueError, match="KernelChoice.sparse_mla"):
        KernelChoice(sparse_mla="deepgemm")  # each kernel has its own implementations


# ---------------------------------------------------------------------------
# running: DeepGEMM stand-in vs the reference, and fallbacks mid-run
# ---------------------------------------------------------------------------
def _paged_case(seed: int, heads: int = 32, page_size: int = 64, tree: bool = False):
    g = torch.Generator().manual_seed(seed)
    d, width, num_rows = 32, 150, 3
    per_row = -(-width // page_size)
    num_pages = num_rows * per_row + 1
    cache = torch.zeros(num_pages, page_size * (d + 4), dtype=torch.uint8)
    ref.store_index_k(cache, torch.arange(num_pages * page_size), torch.randn(num_pages * page_size, d, generator=g),
                      page_size)
    pages = (torch.randperm(num_pages - 1, generator=g) + 1)[: num_rows * per_row].view(num_rows, per_row)
    pos = torch.arange(width)
    r2t = (pages[:, pos // page_size] * page_size + pos % page_size).to(torch.int32)
    rows = torch.tensor([0, 1, 1, 1, 2, 0])
    kv_lens = torch.tensor([150, 60, 61, 62, 1, 100]) - (4 if tree else 0)
    tree_mask = torch.rand(6, 4, generator=g) > 0.5 if tree else None
    q, w = ref.quant_index_q(torch.randn(6, heads, d, generator=g), torch.rand(6, heads, generator=g))
    return q, w, cache, page_size, r2t, rows, kv_lens, width, tree_mask


@in_this_process
@pytest.mark.parametrize("tree", [False, True])
def test_deepgemm_paged_path_matches_reference(sm90, monkeypatch, tree):
    calls: dict = {}
    _with_module(monkeypatch, make_stand_in(calls))
    ops = ops_for(choose())
    args = _paged_case(1 + tree, tree=tree)
    for _ in range(2):
        got = ops.index_logits(*args)
        want = ref.index_logits(*args)
        assert torch.equal(torch.isinf(got), torch.isinf(want)) and not got.isnan().any()
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert calls["paged"] == 2  # the stand-in checked each call's schedule against its context lengths
    assert calls["schedule"] == 2  # the start-up check's two samples: minidsa computed the schedules
    vis_end = args[6] + (4 if tree else 0)
    assert torch.equal(calls["context_lens"][0], vis_end.view(-1, 1).int())


@pytest.mark.skipif(INTERPRETED, reason="pure torch: runs once, in the parent process")
@pytest.mark.parametrize("num_sms", [132, 7])
def test_paged_schedule_is_deepgemms_split(num_sms):
    g = torch.Generator().manual_seed(num_sms)
    cases = [[1], [0], [0, 0, 5], [256], [257, 255, 0, 512], [70000], [3] * 300,
             torch.randint(0, 3000, (97,), generator=g).tolist(), torch.randint(0, 200, (40,), generator=g).tolist()]
    for lens in cases:
        ctx = deepgemm.context_lens_2d(torch.tensor(lens))
        assert torch.equal(deepgemm.paged_schedule(ctx, num_sms), dg_schedule(ctx, num_sms)), lens


@in_this_process
def test_build_with_another_schedule_keeps_its_own_metadata_kernel(sm90, monkeypatch, caplog):
    calls: dict = {}
    _with_module(monkeypatch, make_stand_in(calls, schedule_differs=True))
    with caplog.at_level(logging.WARNING):
        ops = ops_for(choose())
    assert "schedule differs from minidsa's at page size 64" in caplog.text
    calls["schedule"] = 0
    args = _paged_case(5)
    for _ in range(2):
        torch.testing.assert_close(ops.index_logits(*args), ref.index_logits(*args), rtol=1e-4, atol=1e-4)
    assert calls["paged"] == calls["schedule"] == 2  # its metadata made fresh for every call


@in_this_process
def test_deepgemm_ragged_path_for_one_request_prefill(sm90, monkeypatch):
    calls: dict = {}
    _with_module(monkeypatch, make_stand_in(calls))
    ops = ops_for(choose())
    q, w, cache, ps, r2t, _, _, width, _ = _paged_case(3)
    rows = torch.zeros(5, dtype=torch.int64)
    kv_lens = torch.tensor([146, 147, 148, 149, 150])  # the last 5 tokens of a 150-token prefill
    got = ops.index_logits(q[:5], w[:5], cache, ps, r2t, rows, kv_lens, width, None, 1)
    want = ref.index_logits(q[:5], w[:5], cache, ps, r2t, rows, kv_lens, width, None)
    assert calls.get("ragged") == 1 and "paged" not in calls
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@in_this_process
def test_deepgemm_failing_mid_run_switches_to_triton(sm90, monkeypatch, caplog):
    calls: dict = {}
    _with_module(monkeypatch, make_stand_in(calls, fail=True))
    ops = ops_for(choose())
    args = _paged_case(5)
    with caplog.at_level(logging.WARNING):
        first = ops.index_logits(*args)
        second = ops.index_logits(*args)
    want = ref.index_logits(*args)
    torch.testing.assert_close(first, want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(second, want, rtol=1e-4, atol=1e-4)
    # Each call that fails runs Triton (nothing is switched off for the process: other engines may hold other
    # choices); the failure is logged once.
    assert calls["paged"] == 2
    said = [r.getMessage() for r in caplog.records if "fp8_paged_mqa_logits failed" in r.getMessage()]
    assert len(said) == 1 and "Triton" in said[0]


@in_this_process
def test_shapes_deepgemm_cannot_take_use_triton(sm90, monkeypatch, caplog):
    calls: dict = {}
    _with_module(monkeypatch, make_stand_in(calls))
    ops = ops_for(choose())
    for heads, page_size in ((16, 64), (32, 4)):
        args = _paged_case(7, heads=heads, page_size=page_size)
        with caplog.at_level(logging.WARNING):
            got = ops.index_logits(*args)
        torch.testing.assert_close(got, ref.index_logits(*args), rtol=1e-4, atol=1e-4)
    assert "paged" not in calls
    assert "16 indexer heads" in caplog.text and "page size 4" in caplog.text


# ---------------------------------------------------------------------------
# DSABackend end to end: Triton/DeepGEMM ops vs the reference backend
# ---------------------------------------------------------------------------
def _backend(kernels: KernelChoice | None, page_size: int):
    kv = KVCache(2, 8, MLALayout.for_model(32, 16, torch.float32, "auto"),
                 IndexerLayout(32, torch.float32, True, page_size), "cpu", indexer_layers=[True, False])
    table = ReqToTokenTable(4, 256, "cpu")
    libraries = load_libraries(kernels, "cpu") if kernels is not None else None
    return DSABackend(kv, table.req_to_token, index_topk=24, kernels=kernels, libraries=libraries), table


@in_this_process
@pytest.mark.parametrize("with_deep_gemm", [False, True])
def test_dsa_backend_ops_match_reference_backend(sm90, monkeypatch, with_deep_gemm):
    calls: dict = {}
    _with_module(monkeypatch, make_stand_in(calls) if with_deep_gemm else None)
    page_size, heads, lens = 64, 32, [150, 90]
    choice = choose()
    assert choice.index_logits == ("deepgemm" if with_deep_gemm else "triton")
    fast, fast_table = _backend(choice, page_size)
    slow, slow_table = _backend(None, page_size)
    alloc = PageAllocator(8, page_size)
    rows, locs = [], []
    for n in lens:
        row = len(rows)  # rows 0, 1 of both tables
        slots = slots_of(alloc.alloc(pages_needed(n + 1, page_size)), 0, n + 1, page_size)
        fast_table.write(row, 0, slots)
        slow_table.write(row, 0, slots)
        rows.append(row)
        locs.append(slots)
    g = torch.Generator().manual_seed(9)

    def run(batch: ForwardBatch, attend: bool = True):
        t = batch.num_tokens
        k = torch.randn(t, 32, generator=g)
        q, w = torch.randn(t, heads, 32, generator=g), torch.rand(t, heads, generator=g)
        angles = torch.rand(t, 8, generator=g) * 100  # the query rope over 16 of the 32 columns
        cos, sin, interleave = angles.cos(), angles.sin(), t % 2 == 0
        kv = torch.randn(t, 48, generator=g)
        cos, sin = torch.randn(t, 8, generator=g), torch.randn(t, 8, generator=g)
        qm = torch.randn(t, 8, 48, generator=g)
        out = []
        for be in (fast, slow):
            layer = be.layer_caches[0]
            be.store_kv(layer, batch, kv, torch.ones(32), 1e-6, cos, sin)
            be.store_index_k(layer, batch, k, torch.ones(32), torch.zeros(32), 1e-6, cos, sin, True)
            if attend:
                slots = be.index_topk(layer, batch, q, w, cos, sin, interleave)
                positions = slots_to_positions(be.req_to_token, batch.token_rows, slots)
                out.append((slots, positions, be.sparse_mla(layer, qm, slots, 0.2, 32)))
        if not attend:
            return
        (fs, fp, fo), (ss, sp, so) = out
        for i in range(t):
            assert sorted(fs[i].tolist()) == sorted(ss[i].tolist())
            assert sorted(fp[i].tolist()) == sorted(sp[i].tolist())
        # Same key sets; the attention sum runs in another order.
        torch.testing.assert_close(fo, so, rtol=1e-4, atol=1e-4)

    def extend(reqs: list[int], starts: list[int], ends: list[int], attend: bool = True):
        n = [e - s for s, e in zip(starts, ends)]
        loc = torch.cat([locs[r][s:e] for r, s, e in zip(reqs, starts, ends)])
        run(ForwardBatch.build(StepKind.EXTEND, torch.zeros(sum(n), dtype=torch.long), [rows[r] for r in reqs],
                               starts, n, loc, "cpu"), attend)

    # Most of each prompt stored only (the interpreter is slow), then prefill chunks of one and of two
    # requests, then a decode step.
    extend([0, 1], [0, 0], [lens[0] - 9, lens[1] - 3], attend=False)
    extend([0], [lens[0] - 9], [lens[0] - 3])
    extend([0, 1], [lens[0] - 3, lens[1] - 3], [lens[0], lens[1]])
    decode_loc = torch.stack([locs[0][lens[0]], locs[1][lens[1]]])
    run(ForwardBatch.build(StepKind.DECODE, [0, 0], rows, lens, [1, 1], decode_loc, "cpu"))
    if with_deep_gemm:  # the one-request chunk went through fp8_mqa_logits, the others the paged kernel
        assert calls["ragged"] == 1 and calls["paged"] == 2
    # Keys were stored by the Triton kernel on one side and torch on the other: same bytes but for rare roundings.
    same = (fast.kv_cache.index_buffer == slow.kv_cache.index_buffer).float().mean()
    assert same > 0.99
    # The MLA rows' RMSNorm sums in another order: fp32 rows a few ulps apart.
    torch.testing.assert_close(fast.kv_cache.mla_buffer, slow.kv_cache.mla_buffer, rtol=1e-5, atol=1e-6)
    # Tree compaction moves (chained), every layer of both caches in one launch.
    src, dst = locs[0][[3, 7, 9]], locs[0][[2, 3, 4]]
    want_mla, want_index = fast.kv_cache.mla_buffer.clone(), fast.kv_cache.index_buffer.clone()
    ref.kv_move(list(want_mla.unbind(0)), list(want_index.unbind(0)), src, dst, page_size, 32)
    fast.kv_move(src, dst)
    assert torch.equal(fast.kv_cache.mla_buffer, want_mla)
    assert torch.equal(fast.kv_cache.index_buffer, want_index)


# ---------------------------------------------------------------------------
# the measured choice, and an engine with DeepGEMM importable under torch.compile
# ---------------------------------------------------------------------------
@in_this_process
def test_measured_table_routes_each_shape(sm90, monkeypatch):
    """Inside the op, DeepGEMM serves only the shapes measured faster; the rest run the Triton kernel, in
    the same output layout (rows strided to 256 as DeepGEMM returns them)."""
    calls: dict = {}
    _with_module(monkeypatch, make_stand_in(calls))
    monkeypatch.setattr(deepgemm, "DEEPGEMM_PAGED_WINS", ((4, 1 << 30, 0, 1 << 30),))  # 4+ tokens only
    ops = ops_for(choose())
    args = _paged_case(11)  # 6 tokens
    few = (args[0][:2], args[1][:2], *args[2:5], args[5][:2], args[6][:2], *args[7:])
    for case, dg_calls in ((few, 0), (args, 1)):
        got = ops.index_logits(*case)
        assert calls.get("paged", 0) == dg_calls
        assert got.stride(0) == 256 and got.shape[1] == 150
        torch.testing.assert_close(got, ref.index_logits(*case), rtol=1e-4, atol=1e-4)


@in_this_process
def test_engine_with_deep_gemm_importable_compiles_and_generates(sm90, monkeypatch):
    """What broke start-up on the H100: with deep_gemm importable, the compiled decode step traced into the
    DeepGEMM probe (an import inside a compiled region). The choice is made once, at start-up; the traced
    step holds the opaque op and never probes; tokens equal those of the Triton-only engine."""
    from minidsa import LLM, SamplingParams
    from minidsa.common import presets

    raw = presets.preset_config("tiny")
    raw.update(index_n_heads=32, vocab_size=512, num_hidden_layers=2)  # DeepGEMM on SM90: 32 or 64 indexer heads
    monkeypatch.setitem(presets.PRESETS, "tiny-dg", raw)
    kw = dict(model="tiny-dg", device="cpu", dtype="float32", page_size=64, indexer_cache_dtype="fp8",
              kernel_backend="triton", max_total_tokens=1024, max_running_requests=2, cuda_graph_max_bs=2,
              progress=False)
    params = SamplingParams(max_tokens=3, ignore_eos=True, detokenize=False)
    prompts = [list(range(5, 5 + n)) for n in (40, 36)]  # longer than index_topk 32: sparse attention
    want = [o.token_ids for o in LLM(use_deep_gemm=False, **kw).generate(prompts, params)]

    calls: dict = {}
    _with_module(monkeypatch, make_stand_in(calls))
    llm = LLM(**kw)
    assert llm.engine.runner.kernels.index_logits == "deepgemm"

    runner = llm.engine.runner
    traced = compile_without_probing(runner, monkeypatch, deepgemm)
    replays = count_replays(runner.graphs)
    got = [o.token_ids for o in llm.generate(prompts, params)]
    assert got == want
    assert replays[StepKind.DECODE] > 0 and calls["paged"] > 0
    assert any("minidsa.deepgemm_index_logits" in t for g in traced for t in g)


@in_this_process
def test_compiled_prefill_with_deep_gemm_compiles_nothing_after_start_up(sm90, monkeypatch):
    """DeepGEMM's per-step block table is [tokens, pages of context]. A warm-up whose context fits one page made
    its width 1, which Dynamo specialises, so every longer prompt compiled two more layer graphs mid-serving (seen
    on the H100 with the GPU defaults). The start-up warm-up now traces a multi-page context first, then the
    one-page cases: one-token prompts, and prompts of 1 and 3 pages, chunked and mixed, compile nothing more."""
    from torch._dynamo.testing import CompileCounterWithBackend

    from minidsa import LLM, SamplingParams
    from minidsa.common import presets

    raw = presets.preset_config("tiny")
    raw.update(index_n_heads=32, vocab_size=512, num_hidden_layers=2)
    monkeypatch.setitem(presets.PRESETS, "tiny-dg", raw)
    _with_module(monkeypatch, make_stand_in({}))
    llm = LLM(model="tiny-dg", device="cpu", dtype="float32", page_size=64, indexer_cache_dtype="fp8",
              kernel_backend="triton", max_total_tokens=2048, max_running_requests=4, cuda_graph_max_bs=2,
              chunked_prefill_size=64, max_prefill_tokens=96, progress=False)
    assert llm.engine.runner.kernels.index_logits == "deepgemm"
    counter = CompileCounterWithBackend("eager")
    static_fast_paths(llm.engine.runner, None, counter)
    at_start_up = counter.frame_count
    params = SamplingParams(max_tokens=2, ignore_eos=True, detokenize=False)
    g = torch.Generator().manual_seed(1)
    for wave in ([[5], [7]], [torch.randint(2, 500, (n,), generator=g).tolist() for n in (20, 140)]):
        llm.generate(wave, params)
    assert counter.frame_count == at_start_up, "compiled again while serving"



@in_this_process
def test_engines_with_different_kernel_choices_share_a_process(sm90, monkeypatch, caplog):
    """Engines in one process, each with its own kernel choice (the torch references; Triton; Triton with
    DeepGEMM's indexer), generate what each generates alone, in turns. DeepGEMM runs only in the engine that chose
    it, and a call it failed in one engine switched nothing off: the choices and the library live in each engine,
    not in module state."""
    from minidsa import LLM, SamplingParams
    from minidsa.common import presets

    raw = presets.preset_config("tiny")
    raw.update(index_n_heads=32, vocab_size=512, num_hidden_layers=2)  # DeepGEMM on SM90: 32 or 64 indexer heads
    monkeypatch.setitem(presets.PRESETS, "tiny-dg", raw)
    base = dict(model="tiny-dg", device="cpu", dtype="float32", page_size=64, indexer_cache_dtype="fp8",
                max_total_tokens=1024, max_running_requests=2, progress=False)
    kinds = {"torch": dict(kernel_backend="torch"), "triton": dict(kernel_backend="triton", use_deep_gemm=False),
             "deepgemm": dict(kernel_backend="triton")}
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(2, 512, (n,), generator=g).tolist() for n in (40, 36)]  # > index_topk 32: sparse
    params = SamplingParams(max_tokens=3, ignore_eos=True, detokenize=False, temperature=0.8, seed=7)
    calls: dict = {}
    _with_module(monkeypatch, make_stand_in(calls, fail_first=1))  # its first call fails

    def dg_calls() -> int:
        return calls.get("paged", 0) + calls.get("ragged", 0)

    def run(llm) -> list[list[int]]:
        return [o.token_ids for o in llm.generate(prompts, params)]

    alone = {}
    with caplog.at_level(logging.ERROR):
        for name, kw in kinds.items():  # each engine alone: built, run and closed before the next
            with LLM(**base, **kw) as llm:
                alone[name] = run(llm)
    assert [r.getMessage() for r in caplog.records if "failed" in r.getMessage()] == [
        "DeepGEMM fp8_paged_mqa_logits failed: RuntimeError: stand-in: DG_HOST_ASSERT failed; the Triton indexer "
        "kernels serve each call it fails"]

    engines = {name: LLM(**base, **kw) for name, kw in kinds.items()}
    chosen = {name: llm.engine.runner.kernels for name, llm in engines.items()}
    assert {n: (c.index_logits, c.sparse_mla, c.sample) for n, c in chosen.items()} == {
        "torch": ("torch", "torch", "torch"), "triton": ("triton", "triton", "triton"),
        "deepgemm": ("deepgemm", "triton", "triton")}
    for _ in range(2):
        for name, llm in engines.items():
            before = dg_calls()
            assert run(llm) == alone[name], name
            assert (dg_calls() > before) == (name == "deepgemm"), name  # DeepGEMM serves again after the failure
    for llm in engines.values():
        llm.close()


# ---------------------------------------------------------------------------
# the dense FP8 GEMM: row classes, so DeepGEMM's per-tile-choice JIT happens at start-up
# ---------------------------------------------------------------------------
@pytest.mark.skipif(INTERPRETED, reason="pure arithmetic: runs once, in the parent process")
def test_gemm_rows_are_few_classes_with_little_padding():
    classes = deepgemm_warmup.gemm_row_classes(8192)
    assert len(classes) < 60 and classes == sorted(set(classes)) and classes[-1] == 8192
    for m in range(1, 8193):
        rows = deepgemm.gemm_rows(m)
        assert rows >= m and rows in classes
        assert rows - m < (16 if m <= 128 else m / 8)  # 12.5% at most past 128 rows
        assert deepgemm.gemm_rows(rows) == rows


def gemm_stand_in(rows_seen: list):
    """DeepGEMM's fp8_gemm_nt contract in torch: out = (e4m3 a x its 1x128 scales) @ (e4m3 b x 128x128)^T."""
    def fp8_gemm_nt(a, b, out):
        (a8, a_s), (w8, w_s) = a, b
        assert a8.dtype == w8.dtype == torch.float8_e4m3fn and out.dtype == torch.bfloat16
        assert a8.shape[0] == a_s.shape[0] == out.shape[0]
        rows_seen.append(a8.shape[0])
        acts = a8.float() * a_s.repeat_interleave(128, 1)[:, :a8.shape[1]]
        out.copy_(acts @ fp8.dequant_block(w8, w_s).T)

    return types.SimpleNamespace(fp8_gemm_nt=fp8_gemm_nt, __version__="stand-in")


@in_this_process
def test_fp8_gemm_runs_row_classes_and_start_up_compiles_every_one(sm90, monkeypatch):
    rows_seen: list = []
    _with_module(monkeypatch, gemm_stand_in(rows_seen))
    module, status = deepgemm.probe(torch.device("cpu"), deepgemm.GEMM_API)
    assert status.available
    handle = deepgemm.DeepGEMM(module, status, "cpu")
    g = torch.Generator().manual_seed(0)
    w8, ws = fp8.quant_block(torch.randn(192, 256, generator=g))
    # Start-up: every class up to 300 rows, once per weight shape (the second weight has the same shape).
    calls = deepgemm_warmup.warm_up_fp8_gemms(handle, [(w8, ws), (w8.clone(), ws.clone())], max_rows=300)
    warmed = set(rows_seen)
    served = [r for r in deepgemm_warmup.gemm_row_classes(300) if deepgemm.fp8_gemm_wins(r, 192, 256)]  # Triton below
    assert calls == len(rows_seen) and rows_seen == served
    rows_seen.clear()
    for m in (17, 129, 200, 300):  # then any size runs a class compiled at start-up, with the exact result
        x = torch.randn(m, 256, generator=g).bfloat16()
        y = deepgemm.fp8_gemm_nt(module, x, w8, ws)
        assert y.shape == (m, 192) and y.is_contiguous()
        want = fp8.w8a8_block_matmul_reference(x.float(), w8, ws)
        torch.testing.assert_close(y.float(), want, rtol=2e-2, atol=2e-2)
    assert rows_seen == [32, 144, 208, 320] and set(rows_seen) <= warmed


@in_this_process
def test_fp8_linear_op_takes_deepgemm_from_its_argument_and_runs_triton_for_a_failing_call(sm90, monkeypatch,
                                                                                           caplog):
    from minidsa.kernels import custom_ops, fp8_gemm  # noqa: F401  (registers torch.ops.minidsa.fp8_linear)
    from minidsa.kernels.optional_lib import LibraryStatus

    rows_seen: list = []
    _with_module(monkeypatch, gemm_stand_in(rows_seen))
    g = torch.Generator().manual_seed(1)
    w8, ws = fp8.quant_block(torch.randn(192, 256, generator=g))
    x = torch.randn(40, 256, generator=g).bfloat16()  # 40 rows: DeepGEMM is measured faster (fp8_gemm_wins)
    want = fp8.w8a8_block_matmul_reference(x.float(), w8, ws)
    got = torch.ops.minidsa.fp8_linear(x, w8, ws, True)
    assert rows_seen == [48]  # through the module sys.modules holds, as a 48-row class
    torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2)
    torch.ops.minidsa.fp8_linear(x, w8, ws, False)  # the layer's choice says Triton: DeepGEMM is not asked
    assert rows_seen == [48]

    def fp8_gemm_nt(a, b, out):
        raise RuntimeError("stand-in: unsupported scale layout")

    failing = types.SimpleNamespace(fp8_gemm_nt=fp8_gemm_nt, __version__="stand-in")
    _with_module(monkeypatch, failing)
    with caplog.at_level(logging.WARNING):
        for _ in range(2):  # each call Triton's result; the failure said once
            assert torch.equal(torch.ops.minidsa.fp8_linear(x, w8, ws, True), fp8_gemm.w8a8_block_gemm(x, w8, ws))
    said = [r.getMessage() for r in caplog.records if "fp8_gemm_nt failed" in r.getMessage()]
    assert len(said) == 1 and "Triton FP8 GEMM" in said[0]
    # The start-up warm-up through the engine's handle records the failure there and stops.
    handle = deepgemm.DeepGEMM(failing, LibraryStatus(True, "stand-in", 9), "cpu")
    assert deepgemm_warmup.warm_up_fp8_gemms(handle, [(w8, ws)], max_rows=64) == 0
    assert len(handle.failures) == 1 and "fp8_gemm_nt failed: RuntimeError" in handle.failures[0]
