"""The fp32 GEMV in one Triton launch (kernels/gemv.py) against its torch reference, on CPU through Triton's
interpreter, and its wiring: the custom op (the reference above `MAX_TOKENS`), the kernel choice, the model
choosing it at build (`set_fp32_gemv`: the indexer's head weights and the router's gate), tracing under
torch.compile.

Same set-up as tests/test_mla_absorb.py: kernels imported interpreted (or the file re-runs itself in a child
process), new torch.empty outputs poisoned (an element the kernel forgets to write is NaN).

What is compared how: both sides sum fp32 products in different orders (the kernel: per program, then the K
ranges in K order), so each output is within a few fp32 ulps of sum_k |x_k w_nk| * scale, the size of the
terms it adds; checked at 1e-5 of that (K = 7168 rounds ~1e-7 of it here). Repeated calls: the same bits.
"""

from __future__ import annotations

import pytest
import torch

if torch.cuda.is_available():
    pytest.skip("CUDA present: tests/gpu/test_kernels_gpu.py checks the compiled kernels", allow_module_level=True)

from triton_interp import import_kernels_interpreted, poison_new_tensors, run_file_interpreted  # noqa: E402

INTERPRETED = import_kernels_interpreted()
in_this_process = pytest.mark.skipif(not INTERPRETED, reason="runs in the child process below")

from minidsa.kernels import custom_ops  # noqa: E402,F401
from minidsa.kernels import fp8_gemm, gemv  # noqa: E402
# Before any torch.empty is patched: Dynamo takes torch's functions as it finds them when imported, and would
# refuse the real one after a poisoned test had imported it.
import torch._dynamo  # noqa: E402,F401


@pytest.mark.skipif(INTERPRETED, reason="kernels are interpreted in this process")
def test_gemv_in_child_process():
    run_file_interpreted(__file__)


@pytest.fixture(autouse=True)
def poisoned_outputs(monkeypatch):
    poison_new_tensors(monkeypatch)


SCALE = 64**-0.5 * 128**-0.5  # the indexer's weight_scale at V3.2's 64 heads of 128


def _inputs(tokens: int, n: int, k: int, dtype: torch.dtype, seed: int, row_stride: int = 0):
    """x [tokens, k] in `dtype` (a view with rows `row_stride` apart when given, as a slice of a wider
    activation), an fp32 weight [n, k] as the model stores it."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, max(k, row_stride), generator=g).to(dtype)[:, :k]
    return x, torch.randn(n, k, generator=g) * k**-0.5


def _check(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor, scale: float) -> None:
    want = gemv.fp32_gemv_reference(x, w, scale)
    assert got.shape == want.shape and got.dtype == torch.float32 and got.is_contiguous()
    assert not got.isnan().any()
    terms = (x.float().abs() @ w.float().abs().T) * abs(scale)
    assert ((got - want).abs() <= 1e-5 * terms + 1e-30).all(), ((got - want).abs() / terms).max()


CASES = ([(t, n, 7168) for t in sorted({1, 3, gemv.MAX_TOKENS, 16}) for n in (64, 256)]
         + [(t, 37, k) for t in (1, 2, 5) for k in (24, 1000)])


@in_this_process
@pytest.mark.parametrize("tokens,n,k", CASES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_kernel_matches_the_reference(tokens, n, k, dtype):
    """V3.2's shapes (K = 7168; N = 64 head weights, 256 experts) at served token counts and past them (the kernel
    computes any), split K, an odd N and K no block divides; rows of a wider activation."""
    x, w = _inputs(tokens, n, k, dtype, tokens * n + k, row_stride=k + 8)
    assert x.stride(0) == k + 8
    _check(gemv.fp32_gemv(x, w, SCALE), x, w, SCALE)
    _check(torch.ops.minidsa.fp32_gemv(x, w, 1.0), x, w, 1.0)


@in_this_process
def test_paths_and_splits_are_as_documented():
    """One token: K in 7 ranges of 1024, 8 rows of W a program; 16 tokens: chunks of 512 (8192 products); a short K:
    no split."""
    assert gemv.pick_tiles(1, 64, 7168) == gemv.GemvTiles(1, 8, 1024, 7, 8, 1)
    assert gemv.pick_tiles(1, 256, 7168).split_k == 7
    t16 = gemv.pick_tiles(16, 256, 7168)
    assert (t16.block_t, t16.block_n, t16.block_k) == (16, 1, 512)
    assert gemv.pick_tiles(3, 64, 64).split_k == 1


@in_this_process
def test_same_bits_every_call_and_counts_left_at_zero(monkeypatch):
    """The last K range of a tile adds every range's partial in K order: repeated calls give the same bits, and
    every arrival count is back at 0; without counts (a CUDA graph captured before any were made) torch adds the
    partials, to the same values within rounding."""
    for tokens in (1, 16):  # the router's 256 rows; K 3072: three K ranges at one token (7168 served makes 7)
        x, w = _inputs(tokens, 256, 3072, torch.bfloat16, tokens)
        first = gemv.fp32_gemv(x, w, SCALE)
        assert tokens > 1 or gemv.pick_tiles(tokens, 256, 3072).split_k == 3
        assert all(torch.equal(gemv.fp32_gemv(x, w, SCALE), first) for _ in range(2))
        assert int(fp8_gemm.arrival_counts(x.device).abs().sum()) == 0
    monkeypatch.setattr(fp8_gemm, "arrival_counts", lambda device: None)
    torch.testing.assert_close(gemv.fp32_gemv(x, w, SCALE), first, rtol=1e-6, atol=1e-6)


@in_this_process
def test_ranges_are_added_in_k_order():
    """The split sum is the per-range results added left to right, in fp32: exactly, not just closely."""
    x, w = _inputs(2, 40, 3000, torch.float32, 9)
    tiles = gemv.GemvTiles(2, 8, 1024, 3, 4, 2)
    whole = gemv.GemvTiles(2, 8, 1024, 1, 4, 2)
    parts = [gemv.fp32_gemv(x[:, a:b], w[:, a:b], 1.0, whole) for a, b in ((0, 1024), (1024, 2048), (2048, 3000))]
    assert torch.equal(gemv.fp32_gemv(x, w, 1.0, tiles), (parts[0] + parts[1]) + parts[2])


@in_this_process
def test_op_serves_more_tokens_than_the_kernel_with_the_reference(monkeypatch):
    """Above MAX_TOKENS the op is cuBLAS's F.linear (the reference itself: equal, not close), never the kernel."""
    x, w = _inputs(gemv.MAX_TOKENS + 1, 64, 256, torch.bfloat16, 3)

    def no_kernel(*args, **kwargs):
        raise AssertionError("the kernel ran above MAX_TOKENS")

    monkeypatch.setattr(gemv, "fp32_gemv", no_kernel)
    assert torch.equal(torch.ops.minidsa.fp32_gemv(x, w, SCALE), gemv.fp32_gemv_reference(x, w, SCALE))


@in_this_process
def test_empty_and_bad_shapes():
    x, w = _inputs(3, 16, 64, torch.float32, 1)
    assert torch.ops.minidsa.fp32_gemv(x[:0], w, 1.0).shape == (0, 16)
    with pytest.raises(ValueError, match="do not multiply"):
        gemv.fp32_gemv(x[:, :32], w)
    with pytest.raises(ValueError, match="must be one of"):
        gemv.fp32_gemv(x.double(), w)


def test_the_choice_names_the_kernel_where_triton_runs():
    """"triton" wherever the Triton kernels run, "torch" with kernel_backend="torch"; logged with the others."""
    from minidsa.attention import select

    assert select.IMPLS["fp32_gemv"] == ("torch", "triton") and "fp32_gemv" in select.LABELS
    assert select.select_kernels("cpu", kernel_backend="torch").fp32_gemv == "torch"
    if INTERPRETED:
        assert select.select_kernels("cpu", kernel_backend="triton").fp32_gemv == "triton"
    with pytest.raises(ValueError, match="KernelChoice.fp32_gemv"):
        select.KernelChoice(fp32_gemv="cuda")


def _tiny_model(fp32_gemv_kernel: str):
    from minidsa.config import ModelConfig
    from minidsa.models.loader import build_model
    from minidsa.common.presets import preset_config

    raw = preset_config("tiny")
    raw.pop("initializer_range")
    raw.update(vocab_size=256)
    cfg = ModelConfig.from_dict(raw)
    model = build_model(cfg, None, torch.bfloat16, torch.device("cpu"), seed=1, init_std=0.05,
                        fp32_gemv=fp32_gemv_kernel)
    return model, cfg


@in_this_process
def test_model_with_the_kernel_traces_whole_and_decodes_like_f_linear():
    """A model built with fp32_gemv="triton": every indexer and router runs the op; the decode forward traces as
    one graph with no break holding it; a 70-token prefill (the op's reference) gives F.linear's logits exactly, a
    decode step of two requests (the kernel) within fp32-order noise."""
    from harness import PagedDriver

    from minidsa.common.batch import ForwardBatch
    from minidsa.models.deepseek_v32 import Indexer, Router, set_fp32_gemv
    from minidsa.common.plan import StepKind

    model, cfg = _tiny_model("triton")
    users = [m for m in model.modules() if isinstance(m, (Indexer, Router))]
    assert any(isinstance(m, Indexer) for m in users) and any(isinstance(m, Router) for m in users)
    assert all(m.fp32_gemv == "triton" for m in users)
    assert all(m.weight.dtype == torch.float32 for m in users if isinstance(m, Router))
    with pytest.raises(ValueError, match="fp32_gemv kernel"):
        set_fp32_gemv(model, "cuda")
    d = PagedDriver(model, cfg, page_size=1, max_len=96, dtype=torch.bfloat16)
    d.add(list(range(3, 3 + 70)), reserve=4)
    d.add(list(range(5, 5 + 20)), reserve=4)
    rows, seq = [d.reqs[i]["row"] for i in range(2)], [70, 20]
    r2t = d.table.req_to_token
    prefill = ForwardBatch.build(StepKind.EXTEND, list(range(3, 73)), rows[:1], [0], [70], r2t[rows[0], :70].long(),
                                 "cpu")
    decode = ForwardBatch.build(StepKind.DECODE, [7, 9], rows, seq, [1, 1],
                                torch.stack([r2t[r, n].long() for r, n in zip(rows, seq)]), "cpu")
    with torch.no_grad():
        ex = torch._dynamo.explain(model.forward)(decode, d.attn)
    assert ex.graph_break_count == 0, [r.reason for r in ex.break_reasons]
    ops = [str(n.target) for gm in ex.graphs for n in gm.graph.nodes if "fp32_gemv" in str(n.target)]
    # the MTP layer's indexer and router run only in the draft step
    main = [m for layer in model.model.layers[:cfg.num_hidden_layers] for m in layer.modules()
            if isinstance(m, (Indexer, Router))]
    assert len(ops) == len(main), ops
    logits = {}
    for kernel in ("triton", "torch"):
        set_fp32_gemv(model, kernel)
        with torch.no_grad():
            # the same cache rows written again by each pass: the prefill stores them, the decode reads them
            model.forward(ForwardBatch.build(StepKind.EXTEND, list(range(5, 25)), rows[1:], [0], [20],
                                             r2t[rows[1], :20].long(), "cpu"), d.attn)
            logits[kernel] = (model.forward(prefill, d.attn).logits, model.forward(decode, d.attn).logits)
    assert torch.equal(logits["triton"][0], logits["torch"][0])  # 70 tokens: the reference itself
    got, want = logits["triton"][1].float(), logits["torch"][1].float()
    err = (got - want).norm() / want.norm()
    assert err < 1e-2, err
    d.release_all()


_COMPILE_FOR_H100 = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from minidsa.kernels import gemv
sig = {"x_ptr": "*bf16", "w_ptr": "*fp32", "out_ptr": "*fp32", "part_ptr": "*fp32", "arrivals_ptr": "*i32",
       "T": "i32", "N": "i32", "K": "i32", "stride_xt": "i32", "stride_xk": "i32", "stride_wn": "i32",
       "stride_wk": "i32", "k_per_split": "i32", "scale": "fp32", "BLOCK_T": "constexpr", "BLOCK_N": "constexpr",
       "BLOCK_K": "constexpr", "SPLIT": "constexpr", "REDUCE_IN_KERNEL": "constexpr",
       "NUM_STAGES": "constexpr", "PDL": "constexpr"}
for tokens, n in ((1, 64), (1, 256), (3, 256), (4, 64), (16, 256)):  # V3.2's shapes
    t = gemv.pick_tiles(tokens, n, 7168)
    chunks = -(-7168 // t.block_k)
    split = -(-7168 // (-(-chunks // t.split_k) * t.block_k))
    src = ASTSource(gemv._gemv_kernel, sig, constexprs={
        "BLOCK_T": t.block_t, "BLOCK_N": t.block_n, "BLOCK_K": t.block_k, "SPLIT": split,
        "REDUCE_IN_KERNEL": True, "NUM_STAGES": t.num_stages, "PDL": True})
    options = {"num_warps": t.num_warps, "num_stages": t.num_stages}
    assert triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options).asm["cubin"]
print("compiled")
"""


def test_gemv_kernel_compiles_for_h100():
    """The tiles at V3.2's shapes compiled for sm_90 without a GPU: what only Triton's compiler refuses
    fails here."""
    from triton_interp import compile_for_h100

    compile_for_h100(_COMPILE_FOR_H100, "_gemv_kernel")
