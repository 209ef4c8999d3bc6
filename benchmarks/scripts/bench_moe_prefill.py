"""The FP8 prefill MoE before and after branch moe-prefill, side by side in one run, at DeepSeek-V3.2's expert shapes.

    PYTHONPATH=.:$DG python3 benchmarks/scripts/bench_moe_prefill.py --json $OUT/moe_prefill.json   # ~3-5 min on an H100
    (DG: DeepGEMM's built package dir when it is used, e.g. from `eval "$(bash .dg/build.sh)"`; without it the
    DeepGEMM rows are skipped and everything else runs)

Shapes: 256 routed experts, top-8 among 4 of 8 groups (the model's Router on random inputs, as bench_moe.py),
hidden 7168, expert intermediate 2048, FP8 e4m3 weights with 128x128 block scales (w8a8).

Per token count (--tokens, default 4096 8192 16384 32768), whole-op rows (`do_bench` median):
- triton before / triton: the Triton fused MoE as main served it at 4b24a09 (benchmarks/scripts/moe_before.py) and now;
- deepgemm before / deepgemm: DeepGEMM's grouped-GEMM path as served then and now (chunks of 8192 tokens);
- deepgemm, one call: the new path with its chunk raised to the token count (the chunk-size question: at 8192
  tokens DeepGEMM's grouped GEMMs alone measured 49% of the FP8 matmul, 62-67% at 16384 in one call);
- GEMMs alone: DeepGEMM's two grouped GEMMs on inputs laid out beforehand (padding rows -1), per 8192-token chunk
  and in one call: what the path would take with nothing around the GEMMs.
Each with TFLOP/s of the chosen experts' FLOPs (6 * T * k * H * I) against the FP8 matmul ceiling measured in the
same run (`torch._scaled_mm`, per-tensor scales, M 8192 N 4096 K 7168), the peak memory it allocated above its
inputs, and its relative error against the torch reference (T <= 8192) or the Triton path before.

Parts (--parts, on by default): each pass around the GEMMs of the DeepGEMM path timed alone at one chunk
(min(T, 8192) tokens), before and after, with the bytes it must move and GB/s against a device copy measured in
the same run. These run without DeepGEMM too (only the GEMM parts need it).
Writes --json after every row (a cut-short run keeps what it measured); prints a markdown table at the end.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time
import traceback

import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_moe import DEV, E, H, I, K, make_router, routed  # noqa: E402 (the same expert shapes and router)
from moe_before import fused_moe_triton_before, moe_contiguous_before  # noqa: E402

from minidsa.kernels import deepgemm, fp8, moe_layout  # noqa: E402
from minidsa.kernels import fused_moe as fm  # noqa: E402
from minidsa.kernels.fp8_gemm import quant_act  # noqa: E402
from minidsa.models.deepseek_v32 import Router  # noqa: E402

SERVED_CHUNK = fm.MAX_CHUNK_TOKENS  # the Triton path's chunk; DeepGEMM's until 2026-11-26


def ms_of(fn, rep: int = 200) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=rep, return_mode="median")


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want.double()).norm() / want.double().norm()).item()


class Recorder:
    def __init__(self, path: str | None):
        self.path, self.meta, self.rows = path, {}, []

    def add(self, **row) -> None:
        self.rows.append(row)
        print(" | ".join(f"{k}={format(v, '.4g') if isinstance(v, float) else v}" for k, v in row.items()), flush=True)
        self.save()

    def save(self) -> None:
        if self.path:
            os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
            with open(self.path, "w") as f:
                json.dump({"meta": self.meta, "rows": self.rows}, f, indent=1)


def ceilings(rec: Recorder) -> None:
    n = 1 << 30
    src = torch.empty(n, dtype=torch.uint8, device=DEV).random_()
    dst = torch.empty_like(src)
    rec.meta["copy_GBps"] = 2 * n / ms_of(lambda: dst.copy_(src), rep=100) / 1e6
    src = dst = None  # 2 GiB back before the weights
    m, nn, kk = 8192, 4096, H
    xq = torch.randn(m, kk, device=DEV).to(fp8.FP8_DTYPE)
    wq = torch.randn(nn, kk, device=DEV).to(fp8.FP8_DTYPE)
    one = torch.ones((), device=DEV)
    ms = ms_of(lambda: torch._scaled_mm(xq, wq.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16,
                                        use_fast_accum=True), rep=100)
    rec.meta["fp8_TFLOPs"] = 2 * m * nn * kk / ms / 1e9
    print(f"# ceilings: copy {rec.meta['copy_GBps']:.0f} GB/s, fp8 mm {rec.meta['fp8_TFLOPs']:.0f} TFLOP/s", flush=True)


def make_fp8_weights():
    """(gate_up e4m3 [E, 2I, H], down e4m3 [E, H, I], their block scales), quantised one expert at a time."""
    g = torch.Generator(device=DEV).manual_seed(1)
    out = []
    for rows, cols in ((2 * I, H), (H, I)):
        q = torch.empty(E, rows, cols, dtype=fp8.FP8_DTYPE, device=DEV)
        s = torch.empty(E, *fp8.block_scale_shape(rows, cols), device=DEV)
        for e in range(E):
            w = torch.empty(rows, cols, device=DEV, dtype=torch.bfloat16).normal_(0.0, cols**-0.5, generator=g)
            q[e], s[e] = fp8.quant_block(w)
        out.append((q, s))
    (gu, gus), (dn, dns) = out
    return gu, dn, gus, dns


def peak_extra_gib(fn) -> tuple[torch.Tensor, float]:
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = fn()
    torch.cuda.synchronize()
    return out, (torch.cuda.max_memory_allocated() - base) / 2**30


def gemms_alone(gemm, alignment: int, params, ids: torch.Tensor, chunk: int):
    """fn running DeepGEMM's two grouped GEMMs over every chunk of `chunk` tokens, inputs laid out beforehand."""
    gu, dn, gus, dns = params
    calls = []
    for s in range(0, ids.shape[0], chunk):
        layout = moe_layout.expert_rows(ids[s:s + chunk], E, alignment)
        rows = int(layout.num_rows.item())
        m_indices = layout.row_expert[:rows].clone()
        a1 = torch.randn(rows, H, device=DEV).to(fp8.FP8_DTYPE)
        s1 = moe_layout.mn_major_scales(rows, H // 128, DEV).copy_(torch.rand(rows, H // 128, device=DEV) * 0.01)
        a2 = torch.randn(rows, I, device=DEV).to(fp8.FP8_DTYPE)
        s2 = moe_layout.mn_major_scales(rows, I // 128, DEV).copy_(torch.rand(rows, I // 128, device=DEV) * 0.01)
        d1 = torch.empty(rows, 2 * I, device=DEV, dtype=torch.bfloat16)
        d2 = torch.empty(rows, H, device=DEV, dtype=torch.bfloat16)
        calls.append((m_indices, a1, s1, a2, s2, d1, d2))

    def fn():
        for m_indices, a1, s1, a2, s2, d1, d2 in calls:
            gemm((a1, s1), (gu, gus), d1, m_indices)
            gemm((a2, s2), (dn, dns), d2, m_indices)
    return fn


def bench_whole(rec: Recorder, router: Router, params, dg, tokens: list[int], one_call_max: int) -> None:
    ceiling = rec.meta["fp8_TFLOPs"]
    for t in tokens:
        x, ids, w = routed(router, t, seed=t)
        flops = 6.0 * t * K * H * I
        want = fm.fused_moe_reference(x, ids, w, *params) if t <= SERVED_CHUNK else None
        base_out = None

        def add(impl: str, fn, note: str = "", check: bool = True):
            nonlocal base_out
            try:
                out, peak = peak_extra_gib(fn)
                ms = ms_of(fn)
                tf = flops / ms / 1e9
                err = None
                if check:
                    ref = want if want is not None else base_out
                    err = rel_err(out, ref) if ref is not None else None
                    if base_out is None:
                        base_out = out
                rec.add(phase="whole", T=t, impl=impl, ms=ms, TFLOPs=tf, of_fp8_mm=tf / ceiling, peak_extra_GiB=peak,
                        rel_err=err, note=note)
            except Exception as e:
                rec.add(phase="whole", T=t, impl=impl, note=f"failed: {type(e).__name__}: {str(e).splitlines()[0][:160]}")
            torch.cuda.empty_cache()

        add("triton before", lambda: fused_moe_triton_before(x, ids, w, *params), "4b24a09 host code")
        add("triton", lambda: fm.fused_moe_triton(x, ids, w, *params))
        if dg is None:
            continue
        gemm, alignment = dg
        add("deepgemm before", lambda: moe_contiguous_before(gemm, alignment, x, ids, w, *params),
            f"chunks of {SERVED_CHUNK}")
        module = deepgemm.library()
        add("deepgemm", lambda: deepgemm.moe_contiguous(module, x, ids, w, *params),
            f"chunks of {deepgemm.MOE_MAX_CHUNK_TOKENS} (as served)")
        if SERVED_CHUNK < t:
            add(f"deepgemm, chunks of {SERVED_CHUNK}",
                lambda: deepgemm.moe_contiguous(module, x, ids, w, *params, max_chunk_tokens=SERVED_CHUNK),
                "the chunk served until 2026-11-26")
        if deepgemm.MOE_MAX_CHUNK_TOKENS < t <= one_call_max:
            add("deepgemm, one call", lambda: deepgemm.moe_contiguous(module, x, ids, w, *params, max_chunk_tokens=t),
                f"chunk {t}: not served")
        add("GEMMs alone", gemms_alone(gemm, alignment, params, ids, SERVED_CHUNK),
            f"chunks of {SERVED_CHUNK}, padding -1", check=False)
        if t > SERVED_CHUNK:
            add("GEMMs alone, one call", gemms_alone(gemm, alignment, params, ids, t), "padding -1", check=False)


def bench_parts(rec: Recorder, router: Router, params, dg, tokens: list[int]) -> None:
    """Each pass around the grouped GEMMs alone, at one served chunk, before and after; bytes each must move."""
    copy_bw = rec.meta["copy_GBps"]
    gu, dn, gus, dns = params
    alignment = dg[1] if dg is not None else 128
    for t in sorted({min(t, SERVED_CHUNK) for t in tokens}):
        x, ids, w = routed(router, t, seed=t)
        pairs = t * K
        old_blocks = fm.align_pairs_to_blocks(ids, E, alignment)
        rows = int(old_blocks.num_padded.item())
        layout = moe_layout.expert_rows(ids, E, alignment)
        assert int(layout.num_rows.item()) == rows
        m_new = layout.row_expert[:rows]
        m_old = old_blocks.block_expert[:rows // alignment].repeat_interleave(alignment)
        pair_of_row = old_blocks.sorted_pair_ids[:rows].long()
        token_of_row = torch.where(pair_of_row < pairs, pair_of_row // K, 0)
        xq, xs = quant_act(x)
        gate_up = torch.randn(rows, 2 * I, device=DEV).bfloat16()
        down = torch.randn(rows + 1, H, device=DEV).bfloat16()
        old_row_of_pair = torch.full((pairs + 1,), rows, dtype=torch.int32, device=DEV)
        old_row_of_pair[pair_of_row] = torch.arange(rows, dtype=torch.int32, device=DEV)
        old_row_of_pair = old_row_of_pair[:pairs].view(t, K)
        new_row_of_pair = layout.row_of_pair.view(t, K)
        mb = 1e6

        def add(path: str, part: str, fn, nbytes: float | None, note: str = ""):
            try:
                ms = ms_of(fn, rep=100)
                gbs = nbytes / ms / 1e6 if nbytes else None
                rec.add(phase="parts", T=t, rows=rows, path=path, part=part, us=ms * 1e3,
                        MB=nbytes / mb if nbytes else None, GBps=gbs, of_copy=gbs / copy_bw if gbs else None, note=note)
            except Exception as e:
                rec.add(phase="parts", T=t, path=path, part=part,
                        note=f"failed: {type(e).__name__}: {str(e).splitlines()[0][:160]}")

        g1 = H // 128
        g2 = I // 128
        add("before", "align (torch) + sync", lambda: int(fm.align_pairs_to_blocks(ids, E, alignment).num_padded.item()),
            None, "~30 torch ops incl. a stable sort")
        add("before", "quant_act(x)", lambda: quant_act(x), t * H * 2 + t * H + t * g1 * 4)
        add("before", "gather rows + scales", lambda: (xq[token_of_row], xs[token_of_row]),
            2 * rows * H + 2 * rows * g1 * 4)
        add("before", "silu*up quantised, all rows", lambda: fm.silu_mul(gate_up, quantise=True),
            rows * 2 * I * 2 + rows * I + rows * g2 * 4)
        add("before", "combine", lambda: fm.combine_rows(down, old_row_of_pair, w), pairs * H * 2 + t * H * 2)
        add("after", "expert_rows + sync", lambda: int(moe_layout.expert_rows(ids, E, alignment).num_rows.item()),
            None, "2 fills + 3 Triton launches")
        add("after", "quant_scatter", lambda: moe_layout.quant_scatter(x, layout.row_of_pair, rows),
            t * H * 2 + pairs * H + pairs * g1 * 4)
        add("after", "silu*up quantised, real rows", lambda: fm.silu_mul(gate_up, True, m_new, True),
            pairs * 2 * I * 2 + pairs * I + pairs * g2 * 4)
        add("after", "combine", lambda: fm.combine_rows(down, new_row_of_pair, w), pairs * H * 2 + t * H * 2)
        add("triton", "k-sum before (torch)", lambda: down[:pairs].view(t, K, H).sum(1, dtype=torch.float32).bfloat16(),
            pairs * H * 2 + 2 * t * H * 4 + t * H * 2)
        add("triton", "k-sum (combine_rows)", lambda: fm.combine_rows(down[:pairs], None, None, K),
            pairs * H * 2 + t * H * 2)
        if dg is None:
            continue
        gemm = dg[0]
        a1, s1_row = xq[token_of_row], xs[token_of_row]
        s1_mn = moe_layout.mn_major_scales(rows, g1, DEV).copy_(s1_row)
        a2, s2_row = fm.silu_mul(gate_up, quantise=True)
        s2_mn = moe_layout.mn_major_scales(rows, g2, DEV).copy_(s2_row)
        d1 = torch.empty(rows, 2 * I, device=DEV, dtype=torch.bfloat16)
        d2 = torch.empty(rows, H, device=DEV, dtype=torch.bfloat16)
        add("before", "gate|up GEMM", lambda: gemm((a1, s1_row), (gu, gus), d1, m_old), None,
            "padding labelled with its expert; row-major scales")
        add("after", "gate|up GEMM", lambda: gemm((a1, s1_mn), (gu, gus), d1, m_new), None,
            "padding -1; MN-major scales")
        add("before", "down GEMM", lambda: gemm((a2, s2_row), (dn, dns), d2, m_old), None)
        add("after", "down GEMM", lambda: gemm((a2, s2_mn), (dn, dns), d2, m_new), None)


def markdown(meta: dict, rows: list[dict]) -> str:
    out = [f"device {meta.get('device')}, torch {meta.get('torch')}, triton {meta.get('triton')}, commit "
           f"{meta.get('commit')}, {meta.get('date')}; deep_gemm: {meta.get('deep_gemm')}; ceilings this run: "
           f"fp8 mm {meta.get('fp8_TFLOPs', 0):.0f} TFLOP/s, copy {meta.get('copy_GBps', 0):.0f} GB/s", "",
           "| T | impl | ms | TFLOP/s | of FP8 mm | peak GiB | rel err | note |", "|---|---|---|---|---|---|---|---|"]
    f = lambda v, spec: "-" if v is None else format(v, spec)  # noqa: E731
    for r in rows:
        if r["phase"] == "whole":
            out.append(f"| {r['T']} | {r['impl']} | {f(r.get('ms'), '.2f')} | {f(r.get('TFLOPs'), '.0f')} | "
                       f"{f(r.get('of_fp8_mm'), '.1%')} | {f(r.get('peak_extra_GiB'), '.2f')} | "
                       f"{f(r.get('rel_err'), '.1e')} | {r.get('note', '')} |")
    out += ["", "| T | rows | path | part | us | MB | GB/s | of copy | note |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["phase"] == "parts":
            out.append(f"| {r['T']} | {r.get('rows', '-')} | {r['path']} | {r['part']} | {f(r.get('us'), '.1f')} | "
                       f"{f(r.get('MB'), '.0f')} | {f(r.get('GBps'), '.0f')} | {f(r.get('of_copy'), '.0%')} | "
                       f"{r.get('note', '')} |")
    return "\n".join(out) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, nargs="+", default=[4096, 8192, 16384, 32768])
    ap.add_argument("--one-call-max", type=int, default=32768,
                    help="largest token count timed as one DeepGEMM call (its buffers: ~5 GiB at 32768)")
    ap.add_argument("--no-parts", action="store_true", help="skip the per-pass breakdown")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench_moe_prefill: needs a CUDA GPU", file=sys.stderr)
        return 2
    t0 = time.time()
    rec = Recorder(args.json)
    commit = os.environ.get("MINIDSA_COMMIT") or subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip() or "unknown"
    module, status = deepgemm.probe(DEV, deepgemm.GEMM_API)
    dg = deepgemm.grouped_contiguous(module) if module is not None else None
    dg_note = status.reason if dg is not None or module is None else "no contiguous grouped GEMM in this build"
    rec.meta.update(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                    date=datetime.date.today().isoformat(), commit=commit, deep_gemm=dg_note, argv=" ".join(sys.argv))
    ceilings(rec)
    router, params = make_router(), make_fp8_weights()
    print(f"# setup {time.time() - t0:.0f} s; DeepGEMM: {dg_note}", flush=True)
    failed = False
    for name, fn in (("whole", lambda: bench_whole(rec, router, params, dg, args.tokens, args.one_call_max)),
                     ("parts", None if args.no_parts else lambda: bench_parts(rec, router, params, dg, args.tokens))):
        if fn is None:
            continue
        try:
            fn()
        except Exception:
            failed = True
            traceback.print_exc()
    rec.meta["seconds"] = round(time.time() - t0, 1)
    rec.save()
    print()
    print(markdown(rec.meta, rec.rows))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
