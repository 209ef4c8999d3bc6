"""FlashMLA as the served sparse MLA backend: chosen once at start-up, Triton for what it cannot take or after
it fails, never a probe from a step.

No FlashMLA build runs here: a torch stand-in follows its documented Python contract
(flash_mla_interface.py: the FP8 sparse decode's [b, s_q, h, 576] queries over a [blocks, block_size, 1, 656]
e4m3 cache with global slot indices, a scheduler object filled on its first call and checked against the
shapes after; the bf16 sparse prefill's [s_q, 1, topk] indices) and computes the reference on the dequantised
values. It is injected as `sys.modules["flash_mla"]`, and the CPU passes for an SM90 GPU through
`optional_lib.cuda_capability` (both monkeypatched here). The Triton kernels run through Triton's interpreter
(bf16 under `torch_rounded_casts`).
"""

from __future__ import annotations

import logging
import sys
import types

import pytest
import torch

if torch.cuda.is_available():
    pytest.skip("CUDA present: tests/gpu/test_flashmla_gpu.py checks the real FlashMLA", allow_module_level=True)

from triton_interp import import_kernels_interpreted, run_file_interpreted, torch_rounded_casts  # noqa: E402

INTERPRETED = import_kernels_interpreted()
in_this_process = pytest.mark.skipif(not INTERPRETED, reason="runs in the child process below")

from minidsa.attention.backend import bind_ops  # noqa: E402
from minidsa.attention.select import KernelChoice, load_libraries, select_kernels  # noqa: E402
from minidsa.kernels import flashmla, optional_lib  # noqa: E402
from minidsa.kernels import reference as ref  # noqa: E402
from minidsa.common.kv_cache import MLALayout  # noqa: E402

LATENT, ROPE = 512, 64


@pytest.mark.skipif(INTERPRETED, reason="kernels are interpreted in this process")
def test_flashmla_dispatch_in_child_process():
    run_file_interpreted(__file__, timeout=900)


# ---------------------------------------------------------------------------
# a torch stand-in for flash_mla, following its documented contract
# ---------------------------------------------------------------------------
class _SchedMeta:
    """FlashMLASchedMeta's role: empty until its first call, then bound to that call's shapes."""

    def __init__(self):
        self.have_initialized = False
        self.config = None


def make_stand_in(calls: dict, fail: bool = False, drop: str | None = None) -> types.ModuleType:
    mod = types.ModuleType("flash_mla")
    mod.__version__ = "stand-in"

    def count(name):
        calls[name] = calls.get(name, 0) + 1

    def get_mla_metadata(*args, **kwargs):
        count("metadata")
        return _SchedMeta(), None

    def flash_mla_with_kvcache(q, k_cache, block_table, cache_seqlens, head_dim_v, tile_scheduler_metadata,
                               num_splits=None, softmax_scale=None, causal=False, is_fp8_kvcache=False,
                               indices=None, **unused):
        count("decode")
        calls.setdefault("decode_q", []).append(q)
        if fail:
            raise RuntimeError("stand-in: CUDA error: an illegal memory access was encountered")
        b, s_q, heads, dk = q.shape
        assert q.dtype == torch.bfloat16 and dk == 576 and head_dim_v == 512 and heads in (64, 128)
        assert k_cache.dtype == torch.float8_e4m3fn and k_cache.dim() == 4 and k_cache.shape[2:] == (1, 656)
        assert block_table is None and cache_seqlens is None and num_splits is None
        assert is_fp8_kvcache and not causal and not unused
        assert indices.dtype == torch.int32 and indices.shape[:2] == (b, s_q) and indices.shape[2] % 64 == 0
        meta = tile_scheduler_metadata
        config = (b, s_q, heads, k_cache.shape[1], indices.shape[2])
        if not meta.have_initialized:
            meta.have_initialized, meta.config = True, config
        assert meta.config == config, "scheduler metadata reused for another shape"
        rows = k_cache.view(torch.uint8).reshape(-1, 656)  # slot = block * block_size + offset
        out = ref.sparse_mla(q.reshape(b * s_q, heads, dk), rows, indices.reshape(b * s_q, -1), softmax_scale,
                             head_dim_v)
        return out.view(b, s_q, heads, head_dim_v), torch.zeros(b, heads, s_q)

    def flash_mla_sparse_fwd(q, kv, indices, sm_scale, d_v=512, attn_sink=None, topk_length=None):
        count("prefill")
        calls.setdefault("prefill_q", []).append(q)
        if fail:
            raise RuntimeError("stand-in: CUDA error")
        s_q, heads, dk = q.shape
        assert heads in (64, 128)
        assert q.dtype == kv.dtype == torch.bfloat16 and kv.dim() == 3 and kv.shape[1:] == (1, dk)
        assert indices.dtype == torch.int32 and indices.shape[:2] == (s_q, 1) and indices.shape[2] % 128 == 0
        out = ref.sparse_mla(q, kv[:, 0], indices[:, 0], sm_scale, d_v)
        return out, torch.zeros(s_q, heads), torch.zeros(s_q, heads)

    for fn in (get_mla_metadata, flash_mla_with_kvcache, flash_mla_sparse_fwd):
        if fn.__name__ != drop:
            setattr(mod, fn.__name__, fn)
    return mod


@pytest.fixture
def sm90(monkeypatch, fresh_log_once):
    """Pretend the CPU is an SM90 GPU for the libraries' probes; fallbacks logged afresh; bf16 in the interpreter."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(optional_lib, "cuda_capability", lambda device: (9, 0))
    with torch_rounded_casts():
        yield


def _with_module(monkeypatch, mod):
    monkeypatch.setitem(sys.modules, "flash_mla", mod)  # None makes `import flash_mla` raise ImportError


def choose(**kw) -> KernelChoice:
    """The Triton / DeepGEMM / FlashMLA choice on the CPU (under the interpreter, as on a GPU)."""
    return select_kernels("cpu", kernel_backend="triton", **kw)


def kept_sched_meta(module) -> int:
    """Scheduler metadata objects kept for `module` (the cache is keyed by the library and the shape)."""
    return sum(1 for key in flashmla._SCHED_META if key[0] is module)


# ---------------------------------------------------------------------------
# choosing
# ---------------------------------------------------------------------------
@in_this_process
def test_stand_in_is_chosen_at_start_up_and_logged(sm90, monkeypatch, caplog):
    _with_module(monkeypatch, make_stand_in({}))
    with caplog.at_level(logging.INFO):
        choice = select_kernels(torch.device("cpu"), kernel_backend="triton")
    assert choice.sparse_mla == "flashmla"
    assert "DSA sparse MLA: FlashMLA" in caplog.text and "flash_mla stand-in on SM90" in caplog.text
    assert "sparse_mla=flashmla" in caplog.text
    handle = load_libraries(choice, "cpu").flashmla  # what each rank holds: the module and why it serves
    assert handle.module is sys.modules["flash_mla"] and handle.status.reason == "flash_mla stand-in on SM90"


@in_this_process
def test_missing_incomplete_wrong_gpu_or_disabled_means_triton(sm90, monkeypatch, caplog):
    _with_module(monkeypatch, None)
    with caplog.at_level(logging.INFO):
        assert choose().sparse_mla == "triton"
    assert "import flash_mla failed" in caplog.text
    _with_module(monkeypatch, make_stand_in({}, drop="flash_mla_sparse_fwd"))
    with caplog.at_level(logging.INFO):
        assert choose().sparse_mla == "triton"
    assert "flash_mla lacks flash_mla_sparse_fwd" in caplog.text
    _with_module(monkeypatch, make_stand_in({}))
    with caplog.at_level(logging.INFO):
        assert choose(use_flash_mla=False).sparse_mla == "triton"
    assert "FlashMLA disabled by use_flash_mla=False" in caplog.text
    monkeypatch.setattr(optional_lib, "cuda_capability", lambda device: (10, 0))
    module, status = flashmla.probe(torch.device("cpu"))
    assert module is None and not status.available and "SM100" in status.reason
    assert choose().sparse_mla == "triton"


@in_this_process
def test_heads_per_rank_decide_at_start_up(sm90, monkeypatch, caplog):
    """Tensor parallelism's heads per rank: 64 and 128 as they are; fewer that divide 64 served padded to 64 (and
    logged so); others Triton, decided once at start-up."""
    _with_module(monkeypatch, make_stand_in({}))
    for heads in (128, 64):
        caplog.clear()
        with caplog.at_level(logging.INFO):
            assert choose(mla_heads=heads).sparse_mla == "flashmla"
        assert "padded" not in caplog.text
    for heads in (32, 16):
        caplog.clear()
        with caplog.at_level(logging.INFO):
            assert choose(mla_heads=heads).sparse_mla == "flashmla"
        said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("DSA sparse MLA")]
        assert len(said) == 1 and f"{heads} heads per rank padded to 64" in said[0], said
    for heads in (24, 48, 96, 256):
        caplog.clear()
        with caplog.at_level(logging.INFO):
            assert choose(mla_heads=heads).sparse_mla == "triton"
        assert f"FlashMLA cannot serve this engine: {heads} heads per rank" in caplog.text
    assert [flashmla.padded_heads(h) for h in (128, 64, 32, 16, 8, 1, 24, 48, 96)] == \
        [128, 64, 64, 64, 64, 64, None, None, None]


def test_engine_start_up_passes_heads_per_rank(monkeypatch):
    """choose_kernels hands select_kernels this rank's query heads (the model's over tensor_parallel_size)."""
    from minidsa.attention import select
    from minidsa.common import presets
    from minidsa.config import EngineConfig, ModelConfig, resolve
    from minidsa.exec.build import choose_kernels

    seen = {}

    def record(*args, **kwargs):
        seen["heads"] = args[6] if len(args) > 6 else kwargs.get("mla_heads")
        return KernelChoice()

    monkeypatch.setattr(select, "select_kernels", record)
    raw = presets.preset_config("tiny")
    raw.pop("initializer_range", None)
    model = ModelConfig.from_dict(raw)
    choose_kernels(resolve(EngineConfig(model=None, device="cpu"), model))
    assert seen["heads"] == model.num_attention_heads
    choose_kernels(resolve(EngineConfig(model=None, device="cpu", tensor_parallel_size=2), model))
    assert seen["heads"] == model.num_attention_heads // 2


def test_disable_flag_reaches_the_engine_config():
    from minidsa import cli

    parser = cli.build_parser()
    assert cli.engine_config_from_args(parser.parse_args(["generate", "--disable-flash-mla"])).use_flash_mla is False
    assert cli.engine_config_from_args(parser.parse_args(["generate"])).use_flash_mla is True


# ---------------------------------------------------------------------------
# serving: the op routes per shape, falls back to Triton
# ---------------------------------------------------------------------------
def _case(seed: int, tokens: int, heads: int = 64, topk: int = 128, fp8: bool = True, slots: int = 256,
          dtype=torch.bfloat16, latent: int = LATENT, rope: int = ROPE):
    g = torch.Generator().manual_seed(seed)
    rows = torch.randn(slots, latent + rope, generator=g)
    if fp8:
        cache = MLALayout.for_model(latent, rope, torch.bfloat16, "fp8").allocate(1, slots, "cpu")[0]
        ref.store_mla(cache, torch.arange(slots), rows.bfloat16(), latent)
    else:
        cache = rows.to(dtype)
    q = (torch.randn(tokens, heads, latent + rope, generator=g) * 0.3).to(dtype)
    idx = torch.randint(0, slots, (tokens, topk), generator=g, dtype=torch.int32)
    idx[0, topk // 3:] = -1  # a token with fewer keys than the top-k width
    return q, cache, idx, 0.05, latent


def _ops():
    """The ops a DSABackend of an engine with FlashMLA binds (its libraries loaded as an engine loads them)."""
    choice = choose()
    return bind_ops(choice, load_libraries(choice, "cpu"))


def _close(got, case):
    want = ref.sparse_mla(*case)
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)


@in_this_process
def test_fp8_decode_served_by_flashmla_with_metadata_per_shape(sm90, monkeypatch):
    calls: dict = {}
    _with_module(monkeypatch, make_stand_in(calls))
    ops = _ops()
    for tokens in (3, 3, 2):
        case = _case(tokens, tokens)
        _close(ops.sparse_mla(*case), case)
    assert calls["decode"] == 3
    assert calls["metadata"] == 2  # one scheduler object per shape, reused (the stand-in checks its shapes)
    # A cache whose slot count is not a whole number of 64-slot blocks is viewed as blocks of one slot.
    case = _case(4, 2, slots=200)
    _close(ops.sparse_mla(*case), case)
    assert calls["decode"] == 4


@in_this_process
def test_long_fp8_chunks_run_in_pieces(sm90, monkeypatch):
    calls: dict = {}
    _with_module(monkeypatch, make_stand_in(calls))
    monkeypatch.setattr(flashmla, "DECODE_MAX_TOKENS", 4)
    case = _case(5, 10)
    _close(_ops().sparse_mla(*case), case)
    assert calls["decode"] == 3 and calls["metadata"] == 2  # pieces of 4, 4, 2 tokens


@in_this_process
def test_metadata_first_made_during_capture_is_not_kept(sm90, monkeypatch):
    calls: dict = {}
    stand_in = make_stand_in(calls)
    _with_module(monkeypatch, stand_in)
    ops = _ops()
    monkeypatch.setattr(flashmla, "_capturing", lambda: True)
    case = _case(6, 2)
    for _ in range(2):  # made afresh each time: its kernel belongs to the graph being captured
        _close(ops.sparse_mla(*case), case)
    assert calls["metadata"] == 2 and not kept_sched_meta(stand_in)
    monkeypatch.setattr(flashmla, "_capturing", lambda: False)
    ops.sparse_mla(*case)  # warm-up (outside capture) keeps it ...
    monkeypatch.setattr(flashmla, "_capturing", lambda: True)
    ops.sparse_mla(*case)  # ... and the capture reuses it
    assert calls["metadata"] == 3 and kept_sched_meta(stand_in) == 1


@in_this_process
def test_bf16_prefill_served_from_one_wave(sm90, monkeypatch):
    calls: dict = {}
    _with_module(monkeypatch, make_stand_in(calls))
    ops = _ops()
    case = _case(7, 8, fp8=False)  # 8 tokens x 1 CTA of 64 heads = the 8 "SMs" of the CPU stand-in
    _close(ops.sparse_mla(*case), case)
    assert calls["prefill"] == 1
    case = _case(8, 3, fp8=False)  # under one wave: the Triton kernel, which splits the top-k
    _close(ops.sparse_mla(*case), case)
    assert calls["prefill"] == 1 and "decode" not in calls


@in_this_process
@pytest.mark.parametrize("heads", [32, 16])
def test_fewer_heads_are_padded_to_64(sm90, monkeypatch, heads):
    """32 or 16 heads per rank: FlashMLA sees 64 (zero queries in the padding), the op returns the rank's heads,
    equal to the reference; FP8 decode and bf16 prefill alike (small FP8 decode batches at 16 heads go to Triton:
    lowered here so that the padding is what runs)."""
    calls: dict = {}
    _with_module(monkeypatch, make_stand_in(calls))
    monkeypatch.setattr(flashmla, "FP8_QUARTER_HEADS_MIN_TOKENS", 1)
    ops = _ops()
    case = _case(11, 3, heads=heads)
    got = ops.sparse_mla(*case)
    assert got.shape == (3, heads, LATENT) and got.is_contiguous()
    _close(got, case)
    [seen] = calls["decode_q"]  # [b, s_q, 64, 576]: the rank's heads, then zeros
    assert seen.shape == (3, 1, 64, LATENT + ROPE)
    assert torch.equal(seen[:, 0, :heads], case[0]) and not seen[:, :, heads:].any()
    case = _case(12, 8, heads=heads, fp8=False)  # 8 tokens x 1 CTA of 64 (padded) heads: one wave of 8 "SMs"
    got = ops.sparse_mla(*case)
    assert got.shape == (8, heads, LATENT) and got.is_contiguous()
    _close(got, case)
    [seen] = calls["prefill_q"]
    assert seen.shape == (8, 64, LATENT + ROPE)
    assert torch.equal(seen[:, :heads], case[0]) and not seen[:, heads:].any()
    assert flashmla.flashmla_wins(8, heads, False, torch.device("cpu"))


def test_fp8_decode_at_16_heads_takes_flashmla_from_its_measured_batch():
    """Padded 4x, FlashMLA lost to Triton at 1 and 16 query tokens and won at 64 (H200); padded 2x it won at all."""
    cpu = torch.device("cpu")
    n = flashmla.FP8_QUARTER_HEADS_MIN_TOKENS
    assert not flashmla.flashmla_wins(n - 1, 16, True, cpu) and flashmla.flashmla_wins(n, 16, True, cpu)
    assert flashmla.flashmla_wins(1, 32, True, cpu) and flashmla.flashmla_wins(1, 64, True, cpu)
    assert not flashmla.flashmla_wins(0, 32, True, cpu)


@in_this_process
@pytest.mark.parametrize("what", ["heads", "topk", "fp32", "bf16_topk"])
def test_shapes_flashmla_cannot_take_run_triton(sm90, monkeypatch, caplog, what):
    calls: dict = {}
    _with_module(monkeypatch, make_stand_in(calls))
    ops = _ops()
    case, said = {
        "heads": (_case(9, 2, heads=24), "24 heads per rank"),  # neither 64, 128 nor a divisor of 64
        "topk": (_case(9, 2, topk=96), "top-k 96"),
        "fp32": (_case(9, 2, fp8=False, dtype=torch.float32, heads=64, latent=32, rope=16), "torch.float32"),
        "bf16_topk": (_case(9, 8, fp8=False, topk=64), "a multiple of 128"),
    }[what]
    with caplog.at_level(logging.WARNING):
        got = ops.sparse_mla(*case)
    _close(got, case)
    assert not calls.get("decode") and not calls.get("prefill")
    assert "Triton kernel serves this shape (FlashMLA cannot" in caplog.text and said in caplog.text


@in_this_process
def test_failing_call_runs_triton_and_is_logged_once(sm90, monkeypatch, caplog):
    calls: dict = {}
    _with_module(monkeypatch, make_stand_in(calls, fail=True))
    ops = _ops()
    case = _case(10, 2)
    with caplog.at_level(logging.WARNING):
        for _ in range(2):
            _close(ops.sparse_mla(*case), case)
    # Each call that fails runs Triton (nothing is switched off for the process: other engines may hold other
    # choices); the failure is logged once.
    assert calls["decode"] == 2
    said = [r.getMessage() for r in caplog.records if "flash_mla_with_kvcache failed" in r.getMessage()]
    assert len(said) == 1 and "Triton" in said[0] and said[0].startswith("FlashMLA")


# ---------------------------------------------------------------------------
# an engine with FlashMLA importable, compiled, through the graphs' static buffers
# ---------------------------------------------------------------------------
@in_this_process
def test_engine_with_flash_mla_compiles_and_generates_the_triton_tokens(sm90, monkeypatch, caplog):
    """The choice is made once, at start-up, and logged; the compiled steps hold the opaque op and never probe;
    tokens equal those of the Triton engine. FP8 cache: FlashMLA's decode kernel serves prefill and decode.
    (The bf16 prefill path is covered op by op above: an engine run of it costs minutes in the interpreter.)"""
    from dataclasses import replace


    from harness import compile_without_probing, count_replays
    from minidsa.common.plan import StepKind
    from minidsa import LLM, SamplingParams
    from minidsa.common import presets

    from minidsa.attention import select

    # Only sparse MLA differs between the two engines: the other DSA ops run their torch references (the
    # interpreter takes minutes for them at these widths; tests/test_deepgemm_dispatch.py runs them in Triton).
    select_all = select.select_kernels

    def only_sparse_mla(*args, **kwargs):
        real = select_all(*args, **kwargs)
        return replace(KernelChoice(), sparse_mla=real.sparse_mla, fp8_gemm=real.fp8_gemm, moe_gemm=real.moe_gemm)

    monkeypatch.setattr(select, "select_kernels", only_sparse_mla)  # choose_kernels() selects through the module
    raw = presets.preset_config("tiny")
    # FlashMLA's shapes: 64 heads, latent 512 + rope 64, top-k a multiple of 64; the rest tiny.
    raw.update(num_attention_heads=64, num_key_value_heads=64, kv_lora_rank=LATENT, qk_rope_head_dim=ROPE,
               qk_nope_head_dim=16, v_head_dim=16, index_head_dim=64, index_topk=64, vocab_size=512,
               num_hidden_layers=1)
    monkeypatch.setitem(presets.PRESETS, "tiny-fmla", raw)
    kw = dict(model="tiny-fmla", device="cpu", dtype="bfloat16", page_size=64, kv_cache_dtype="fp8",
              kernel_backend="triton", max_total_tokens=1024, max_running_requests=2, cuda_graph_max_bs=2,
              progress=False)
    params = SamplingParams(max_tokens=3, ignore_eos=True, detokenize=False)
    prompts = [list(range(5, 5 + n)) for n in (70, 8)]  # the first longer than index_topk: sparse attention
    want = [o.token_ids for o in LLM(use_flash_mla=False, **kw).generate(prompts, params)]

    calls: dict = {}
    _with_module(monkeypatch, make_stand_in(calls))
    with caplog.at_level(logging.INFO):
        llm = LLM(**kw)
    assert llm.engine.runner.kernels.sparse_mla == "flashmla"
    assert "DSA sparse MLA: FlashMLA" in caplog.text

    runner = llm.engine.runner
    traced = compile_without_probing(runner, monkeypatch, flashmla)
    replays = count_replays(runner.graphs)
    got = [o.token_ids for o in llm.generate(prompts, params)]
    assert got == want
    assert replays[StepKind.DECODE] > 0 and calls["decode"] > 0
    assert any("minidsa.flashmla_sparse_mla" in t for g in traced for t in g)
