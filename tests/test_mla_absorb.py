"""MLA's absorbed W_UK / W_UV products in one Triton launch each (kernels/mla_absorb.py) against their torch
references, on CPU through Triton's interpreter, and their wiring: the custom ops (the reference above
`MAX_TOKENS`), the model choosing them at build (`set_mla_absorb`), tracing under torch.compile.

Same set-up as tests/test_norm_quant.py: kernels imported interpreted (or the file re-runs itself in a child
process), new torch.empty outputs poisoned, the interpreter's bf16 tl.dot patched to multiply values
(`torch_rounded_casts`).

What is compared how: both sides accumulate in fp32, in different orders. fp32 outputs within a few fp32 ulps of
the largest product sum; bf16 outputs never more than one bf16 ulp apart and mostly equal (an fp32-order
difference moves a bf16 rounding only near a tie); the rotated rope columns exactly (the same fp32 operations).
"""

from __future__ import annotations

import pytest
import torch

if torch.cuda.is_available():
    pytest.skip("CUDA present: tests/gpu/test_kernels_gpu.py checks the compiled kernels", allow_module_level=True)

from triton_interp import (SPILL_CHECK, import_kernels_interpreted, poison_new_tensors,  # noqa: E402
                           run_file_interpreted, torch_rounded_casts)

INTERPRETED = import_kernels_interpreted()
in_this_process = pytest.mark.skipif(not INTERPRETED, reason="runs in the child process below")

from minidsa.kernels import custom_ops  # noqa: E402,F401
from minidsa.kernels import mla_absorb  # noqa: E402
from minidsa.kernels import reference as ref  # noqa: E402
# Before any torch.empty is patched: Dynamo takes torch's functions as it finds them when imported, and would
# refuse the real one after a poisoned test had imported it.
import torch._dynamo  # noqa: E402,F401


@pytest.mark.skipif(INTERPRETED, reason="kernels are interpreted in this process")
def test_mla_absorb_in_child_process():
    run_file_interpreted(__file__)


@pytest.fixture(autouse=True)
def poisoned_outputs(monkeypatch):
    poison_new_tensors(monkeypatch)


def _inputs(tokens: int, heads: int, nope: int, v: int, latent: int, rope: int, dtype: torch.dtype, seed: int):
    """(q_nope, q_rope, w_uk, w_uv, o_latent, cos, sin) as the model holds them: q_nope / q_rope slices of one q
    row per head, W_UK / W_UV views of kv_b_proj's weight, o_latent a row-strided view, fp32 cos / sin [T, rope/2]
    of far-apart positions scaled by a YaRN-like attention factor."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(tokens, heads, nope + rope, generator=g).to(dtype)
    kv_b = (torch.randn(heads * (nope + v), latent, generator=g) * latent**-0.5).to(dtype)
    w = kv_b.view(heads, nope + v, latent)
    o_latent = torch.randn(tokens, heads, latent + 8, generator=g).to(dtype)[..., :latent]
    angles = torch.randint(0, 1 << 17, (tokens, 1), generator=g).float() * torch.rand(rope // 2, generator=g)
    return q[..., :nope], q[..., nope:], w[:, :nope], w[:, nope:], o_latent, angles.cos() * 1.3, angles.sin() * 1.3


def _ulps_apart(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """|a - b| in units of the last place of b's dtype at b (0 where equal)."""
    eps = torch.finfo(b.dtype).eps
    ulp = torch.where(b.float() != 0, b.float().abs() * eps, torch.finfo(b.dtype).tiny)
    return (a.float() - b.float()).abs() / ulp


def _check(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype and got.is_contiguous()
    assert not got.isnan().any()
    if want.dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
        return
    apart = _ulps_apart(got, want)
    # two bf16 roundings of nearly equal fp32 sums: at most one spacing apart, and only near a tie
    assert apart.max() <= 1.0, apart.max()
    assert (apart == 0).float().mean() >= 0.95, (apart == 0).float().mean()


SMALL = [(32, 32, 64, 16), (64, 64, 128, 16)]  # nope, v, L, rope
CASES = ([(t, h, dims, dtype) for t in (1, 2, 5, 17) for h in (2, 8) for dims in SMALL[:1]
          for dtype in (torch.bfloat16, torch.float32)]
         + [(t, 8, SMALL[1], torch.bfloat16) for t in (1, 17)]
         + [(t, 2, (128, 128, 512, 64), dtype) for t in (1, 5) for dtype in (torch.bfloat16, torch.float32)])


@in_this_process
@pytest.mark.parametrize("tokens,heads,dims,dtype", CASES)
def test_kernels_match_their_references(tokens, heads, dims, dtype):
    nope, v, latent, rope = dims
    q_nope, q_rope, w_uk, w_uv, o_latent, cos, sin = _inputs(tokens, heads, nope, v, latent, rope, dtype,
                                                             tokens * heads)
    with torch_rounded_casts():
        q_full = torch.ops.minidsa.absorb_q(q_nope, q_rope, w_uk, cos, sin)
        o = torch.ops.minidsa.absorb_o(o_latent, w_uv)
    want_q = mla_absorb.absorb_q_reference(q_nope, q_rope, w_uk, cos, sin)
    _check(q_full, want_q)
    assert torch.equal(q_full[..., latent:], ref.rope_interleaved(q_rope, cos.unsqueeze(1), sin.unsqueeze(1)))
    _check(o, mla_absorb.absorb_o_reference(o_latent, w_uv))


@in_this_process
def test_kernels_take_any_token_count_and_odd_widths():
    """Past one block of rows (each block reads the weight tile again) and with widths no block divides, as the
    tiny preset's 24 / 32 dims, a rope of 12 (6 pairs); a q_rope with its own strides, cos / sin strided views; fp32
    and bf16."""
    for dtype in (torch.float32, torch.bfloat16):
        q_nope, q_rope, w_uk, w_uv, o_latent, cos, sin = _inputs(70, 3, 24, 40, 48, 12, dtype, 5)
        q_rope = q_rope.transpose(0, 1).contiguous().transpose(0, 1)
        cos, sin = torch.stack([cos, sin], dim=-1).unbind(-1)  # columns 2 apart
        with torch_rounded_casts():
            got = mla_absorb.absorb_q(q_nope, q_rope, w_uk, cos, sin)
            want = mla_absorb.absorb_q_reference(q_nope, q_rope, w_uk, cos, sin)
            _check(got, want)
            assert torch.equal(got[..., 48:], want[..., 48:])
            _check(mla_absorb.absorb_o(o_latent, w_uv), mla_absorb.absorb_o_reference(o_latent, w_uv))
            empty = torch.ops.minidsa.absorb_o(o_latent[:0], w_uv)
        assert empty.shape == (0, 3 * 40)


@pytest.fixture
def kernel_refused(monkeypatch):
    """The Triton launch fails the test if anything reaches it (the ops above MAX_TOKENS)."""
    def no_kernel(*args, **kwargs):
        raise AssertionError("the kernel ran above MAX_TOKENS")

    monkeypatch.setattr(mla_absorb, "_launch", no_kernel)


@in_this_process
def test_ops_serve_more_tokens_than_the_kernel_with_the_reference(kernel_refused):
    """Above MAX_TOKENS the ops run cuBLAS's bmm (the reference itself: equal, not close), never the kernel."""
    tokens = mla_absorb.MAX_TOKENS + 1
    q_nope, q_rope, w_uk, w_uv, o_latent, cos, sin = _inputs(tokens, 2, 32, 32, 64, 16, torch.bfloat16, 3)
    assert torch.equal(torch.ops.minidsa.absorb_q(q_nope, q_rope, w_uk, cos, sin),
                       mla_absorb.absorb_q_reference(q_nope, q_rope, w_uk, cos, sin))
    assert torch.equal(torch.ops.minidsa.absorb_o(o_latent, w_uv), mla_absorb.absorb_o_reference(o_latent, w_uv))


@in_this_process
@pytest.mark.parametrize("tokens,heads,v,dtype", [(1, 4, 128, torch.bfloat16), (17, 3, 128, torch.bfloat16),
                                                  (5, 2, 256, torch.bfloat16), (3, 2, 128, torch.float32)])
@pytest.mark.parametrize("deep_gemm_layout", [False, True])
def test_absorb_o_quantises_o_projs_input_bit_for_bit(tokens, heads, v, dtype, deep_gemm_layout):
    """absorb_o with its output quantised in the same launch: o as absorb_o's reference makes it (within the
    accumulation-order noise `_check` allows), the e4m3 bytes and scales exactly `quant_act_per_token_group` of that
    o, in `fp8_gemm.act_buffers`' layout (DeepGEMM's: rows padded to 16, left unwritten, scales MN-major)."""
    from minidsa.kernels import fp8_gemm
    from minidsa.kernels.fp8 import quant_act_per_token_group

    _, _, _, w_uv, o_latent, _, _ = _inputs(tokens, heads, 32, v, 64, 16, dtype, tokens + v)
    with torch_rounded_casts():
        o, q, s = torch.ops.minidsa.absorb_o_quant(o_latent, w_uv, deep_gemm_layout)
    _check(o, mla_absorb.absorb_o_reference(o_latent, w_uv))
    want_q, want_s = quant_act_per_token_group(o)
    rows = fp8_gemm.deep_gemm_act_rows(tokens) if deep_gemm_layout else tokens
    assert q.shape == (rows, heads * v) and s.shape == (rows, heads * v // 128)
    assert s.stride() == ((1, rows) if deep_gemm_layout else (heads * v // 128, 1))
    assert torch.equal(q[:tokens].view(torch.uint8), want_q.view(torch.uint8)) and torch.equal(s[:tokens], want_s)
    assert torch.isnan(s[tokens:]).all()  # padding rows unwritten
    ref_o, ref_q, ref_s = mla_absorb.absorb_o_quant_reference(o_latent, w_uv, deep_gemm_layout)
    assert ref_q.shape == q.shape and ref_s.stride() == s.stride()


@in_this_process
def test_absorb_o_quant_above_max_tokens_is_the_reference_and_refuses_partial_groups(kernel_refused):
    tokens = mla_absorb.MAX_TOKENS + 1
    _, _, _, w_uv, o_latent, _, _ = _inputs(tokens, 2, 32, 128, 64, 16, torch.bfloat16, 9)
    with torch_rounded_casts():
        got = torch.ops.minidsa.absorb_o_quant(o_latent, w_uv, True)
    want = mla_absorb.absorb_o_quant_reference(o_latent, w_uv, True)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1][:tokens].view(torch.uint8),
                                                        want[1][:tokens].view(torch.uint8))
    assert torch.equal(got[2][:tokens], want[2][:tokens]) and got[2].stride() == want[2].stride()
    _, _, _, w_uv, o_latent, _, _ = _inputs(2, 2, 32, 32, 64, 16, torch.bfloat16, 9)
    assert mla_absorb.quant_unsupported(32) is not None and mla_absorb.quant_unsupported(256) is None
    with pytest.raises(ValueError, match="multiple of 128"):
        mla_absorb.absorb_o_quant(o_latent, w_uv)


@in_this_process
def test_bad_shapes_are_refused():
    q_nope, q_rope, w_uk, w_uv, o_latent, cos, sin = _inputs(3, 2, 32, 32, 64, 16, torch.float32, 1)
    with pytest.raises(ValueError, match="does not fit the per-head weight"):
        mla_absorb.absorb_q(q_nope, q_rope, w_uk[:1], cos, sin)
    with pytest.raises(ValueError, match="does not fit the per-head weight"):
        mla_absorb.absorb_o(o_latent[..., :32], w_uv)
    with pytest.raises(ValueError, match="must share one of"):
        mla_absorb.absorb_o(o_latent.bfloat16(), w_uv)
    with pytest.raises(ValueError, match="q_rope"):
        mla_absorb.absorb_q(q_nope, q_rope[:2], w_uk, cos, sin)
    with pytest.raises(ValueError, match="cos / sin"):
        mla_absorb.absorb_q(q_nope, q_rope, w_uk, cos[:, :4], sin[:, :4])
    with pytest.raises(ValueError, match="cos / sin"):
        mla_absorb.absorb_q(q_nope, q_rope, w_uk, cos[:2], sin[:2])


def _tiny_model(mla_absorb_kernel: str):
    from minidsa.config import ModelConfig
    from minidsa.models.loader import build_model
    from minidsa.common.presets import preset_config

    raw = preset_config("tiny")
    raw.pop("initializer_range")
    raw.update(vocab_size=256)  # nope = v = 24, kv_lora_rank 32, rope 16, 4 heads
    cfg = ModelConfig.from_dict(raw)
    model = build_model(cfg, None, torch.bfloat16, torch.device("cpu"), seed=1, init_std=0.05,
                        mla_absorb=mla_absorb_kernel)
    return model, cfg


@in_this_process
def test_model_with_the_kernels_traces_whole_and_decodes_like_the_torch_products():
    """A model built with mla_absorb="triton": every MLA layer (the MTP layer's too) runs the ops; the decode
    forward traces as one graph with no break holding both; a 70-token prefill (the ops' reference) gives the torch
    products' logits exactly, a decode step of two requests (the kernels) within bf16 noise."""
    from harness import PagedDriver

    from minidsa.common.batch import ForwardBatch
    from minidsa.models.deepseek_v32 import MLAttention, set_mla_absorb
    from minidsa.common.plan import StepKind

    model, cfg = _tiny_model("triton")
    layers = [m for m in model.modules() if isinstance(m, MLAttention)]
    assert len(layers) == cfg.num_layers_with_mtp and all(m.absorb == "triton" for m in layers)
    with pytest.raises(ValueError, match="mla_absorb kernel"):
        set_mla_absorb(model, "cuda")
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
    ops = {str(n.target) for gm in ex.graphs for n in gm.graph.nodes if "minidsa" in str(n.target)}
    assert any("absorb_q" in o for o in ops) and any("absorb_o" in o for o in ops), ops
    logits = {}
    for kernel in ("triton", "torch"):
        set_mla_absorb(model, kernel)
        with torch.no_grad(), torch_rounded_casts():
            # the same cache rows written again by each pass: the prefill stores them, the decode reads them
            model.forward(ForwardBatch.build(StepKind.EXTEND, list(range(5, 25)), rows[1:], [0], [20],
                                             r2t[rows[1], :20].long(), "cpu"), d.attn)
            logits[kernel] = (model.forward(prefill, d.attn).logits, model.forward(decode, d.attn).logits)
    assert torch.equal(logits["triton"][0], logits["torch"][0])  # 70 tokens: the reference itself
    got, want = logits["triton"][1].float(), logits["torch"][1].float()
    err = (got - want).norm() / want.norm()
    assert err < 1e-2, err
    d.release_all()


_COMPILE_FOR_H100 = SPILL_CHECK + """
from minidsa.kernels import mla_absorb
sig = {"a_ptr": "*bf16", "b_ptr": "*bf16", "out_ptr": "*bf16", "rope_ptr": "*bf16", "cos_ptr": "*fp32",
       "sin_ptr": "*fp32", "q_ptr": "*fp8e4nv", "s_ptr": "*fp32", "T": "i32", "K": "i32", "N": "i32", "ROPE": "i32",
       "stride_at": "i32", "stride_ah": "i32", "stride_ak": "i32", "stride_bh": "i32", "stride_bk": "i32",
       "stride_bn": "i32", "stride_ot": "i32", "stride_oh": "i32", "stride_rt": "i32", "stride_rh": "i32",
       "stride_ct": "i32", "stride_qt": "i32", "stride_st": "i32", "stride_sg": "i32", "BLOCK_T": "constexpr",
       "BLOCK_K": "constexpr", "BLOCK_N": "constexpr", "BLOCK_R": "constexpr", "HAS_ROPE": "constexpr",
       "QUANT": "constexpr", "PRECISION": "constexpr", "EMULATE_CAST": "constexpr", "PDL": "constexpr"}
# absorb_q's tiles (with the query rope), absorb_o's, and absorb_o's quantising its output (1 to 64 tokens)
for q_side, quant, tokens in ((True, False, 1), (False, False, 1), (False, True, 1), (False, True, 32),
                              (False, True, 64)):
    t = mla_absorb._tiles(tokens, 128, 128 if q_side else 512, 512 if q_side else 128, not q_side, quant)
    src = ASTSource(mla_absorb._head_matmul_kernel, sig, constexprs={
        "BLOCK_T": t.block_t, "BLOCK_K": t.block_k, "BLOCK_N": t.block_n, "BLOCK_R": 64, "HAS_ROPE": q_side,
        "QUANT": quant, "PRECISION": "tf32", "EMULATE_CAST": False, "PDL": True})
    options = {"num_stages": t.num_stages, "enable_fp_fusion": not q_side}
    if quant:
        compile_without_spills(src, t.num_warps, **options)
    else:
        assert triton.compile(src, target=target, options={"num_warps": t.num_warps, **options}).asm["cubin"]
print("compiled")
"""


def test_head_matmul_kernel_compiles_for_h100():
    """Both products' tiles compiled for sm_90 without a GPU: what only Triton's compiler refuses fails here; the
    quantising absorb_o's with no register spills by ptxas's count at 1, 32 and 64 tokens."""
    from triton_interp import compile_for_h100

    compile_for_h100(_COMPILE_FOR_H100, "_head_matmul_kernel")
