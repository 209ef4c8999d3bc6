"""Benchmark the fused MoE (minidsa.kernels.fused_moe) at DeepSeek-V3.2's expert shapes on one GPU.

    PYTHONPATH=. python3 benchmarks/scripts/bench_moe.py --json out/moe.json [--markdown out/moe.md]  # ~2-3 min, H100
    PYTHONPATH=. python3 benchmarks/scripts/bench_moe.py --sweep ...     # also a few other tile configs

Shapes: 256 routed experts, top-8 among 4 of 8 groups (the model's Router on random inputs), hidden 7168,
expert intermediate 2048; bf16 weights and the same weights in FP8 (e4m3, 128x128 block scales, w8a8).

- Decode (T = 1, 8, 32, 128, 256): the whole op (alignment, both GEMMs, k-sum) timed inside a CUDA graph
  (20 calls per replay); GB/s of the chosen experts' weight bytes (each read once) against a device copy's
  bandwidth (bytes read + written) measured in the same run. Beside it: DeepGEMM's
  m_grouped_fp8_gemm_nt_masked (the two GEMMs only: no
  routing, activation quantisation, SiLU or k-sum) when `import deep_gemm` works.
- Prefill (T = 2048, 8192, 16384): TFLOP/s of the chosen experts' FLOPs (6 * T * k * H * I) against the
  same run's matmul ceiling for the dtype (torch.mm bf16; torch._scaled_mm FP8 per-tensor scaled, fast
  accumulation) at M 8192, N 4096, K 7168. Beside it: DeepGEMM's m_grouped_fp8_gemm_nt_contiguous
  (GEMMs only, rows padded per expert to its alignment).
Writes --json / --markdown after every row (a cut-short run keeps what it measured); prints the markdown
table at the end.
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
from types import SimpleNamespace

import torch
import triton

from minidsa.bench import decode_suite as perf
from minidsa.kernels import deepgemm, fp8
from minidsa.kernels import fused_moe as fm
from minidsa.models.deepseek_v32 import Router

DEV = torch.device("cuda")
E, H, I, K, N_GROUP, TOPK_GROUP = 256, 7168, 2048, 8, 8, 4
DECODE = (1, 8, 32, 128, 256)
PREFILL = (2048, 8192, 16384)
SWEEP = {  # --sweep: other tiles (block_m, block_n, block_k, group_m, warps, stages) at a few sizes
    "decode": [fm.TileConfig(16, 32, 128, 1, 4, 4), fm.TileConfig(16, 64, 128, 1, 4, 5),
               fm.TileConfig(16, 128, 128, 1, 4, 3), fm.TileConfig(16, 64, 128, 1, 2, 4),
               fm.TileConfig(32, 64, 128, 1, 4, 4)],
    # Prefill (FP8 needs block_k 128). Measured at 8192 tokens on an H100 (commit 49630c3): M64 N256 w8 s3 512
    # TFLOP/s (now the default), M64 N128 w4 s3 440, split gate/up M64 N128 489, M128 N128 w8 170 (the old default).
    "prefill": [fm.TileConfig(64, 128, 128, 8, 4, 3), fm.TileConfig(64, 256, 128, 16, 8, 3),
                fm.TileConfig(64, 256, 128, 4, 8, 3), fm.TileConfig(64, 256, 128, 8, 4, 3),
                fm.TileConfig(64, 128, 128, 8, 8, 4),
                # gate/up as one GEMM over 2I (one accumulator), silu * up with the down input's quantisation
                fm.TileConfig(64, 256, 128, 8, 8, 3, split_gate_up=True),
                fm.TileConfig(64, 256, 128, 8, 8, 4, split_gate_up=True),
                fm.TileConfig(64, 128, 128, 8, 4, 3, split_gate_up=True)],
}


class Recorder:
    def __init__(self, json_path: str | None, markdown_path: str | None):
        self.rows: list[dict] = []
        self.meta: dict = {}
        self.json_path, self.markdown_path = json_path, markdown_path

    def add(self, **r) -> None:
        self.rows.append(r)
        print(" | ".join(f"{k}={_f(v)}" for k, v in r.items()), flush=True)
        self.save()

    def save(self) -> None:
        for path, text in ((self.json_path, lambda: json.dumps({"meta": self.meta, "rows": self.rows}, indent=1)),
                           (self.markdown_path, lambda: markdown(self.meta, self.rows))):
            if path:
                os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
                with open(path, "w") as f:
                    f.write(text())


def _f(x, spec: str = ".4g") -> str:
    if x is None:
        return "-"
    return format(x, spec) if isinstance(x, float) else str(x)


COLUMNS = ("phase", "dtype", "T", "impl", "us", "experts_hit", "weight_MB", "GB/s", "of_copy", "TFLOP/s", "of_mm",
           "note")


def markdown(meta: dict, rows: list[dict]) -> str:
    lines = [f"# Fused MoE, DeepSeek-V3.2 expert shapes (E {E}, top-{K}, groups {N_GROUP}/{TOPK_GROUP}, H {H}, I {I})",
             "", f"device: {meta.get('device')}, torch {meta.get('torch')}, triton {meta.get('triton')}, "
             f"date {meta.get('date')}, commit {meta.get('commit')}; deep_gemm: {meta.get('deep_gemm')}",
             f"ceilings (this run): copy {_f(meta.get('copy_GBps'), '.0f')} GB/s (read + write), bf16 mm "
             f"{_f(meta.get('bf16_TFLOPs'), '.0f')} TFLOP/s, fp8 _scaled_mm {_f(meta.get('fp8_TFLOPs'), '.0f')} "
             "TFLOP/s", "",
             "| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for r in rows:
        lines.append("| " + " | ".join(_f(r.get(c), ".3g" if c != "us" else ".1f") for c in COLUMNS) + " |")
    return "\n".join(lines) + "\n"


def do_bench_ms(fn, rep: int = 100) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=rep, return_mode="median")


def graph_ms(fn, calls: int = 20, replays: int = 7) -> float:
    """Median milliseconds per call of fn captured `calls` times in one CUDA graph."""
    return perf.graph_time([fn] * calls, replays=replays) * 1e3


def ceilings(rec: Recorder) -> None:
    n = 1 << 30
    a = torch.empty(n, dtype=torch.uint8, device=DEV).random_()
    b = torch.empty_like(a)
    rec.meta["copy_GBps"] = 2 * n / do_bench_ms(lambda: b.copy_(a)) / 1e6
    del a, b
    m, nn, kk = 8192, 4096, H
    x = torch.randn(m, kk, device=DEV, dtype=torch.bfloat16)
    w = torch.randn(nn, kk, device=DEV, dtype=torch.bfloat16)
    rec.meta["bf16_TFLOPs"] = 2 * m * nn * kk / do_bench_ms(lambda: x @ w.t()) / 1e9
    try:
        xq, wq = x.to(fp8.FP8_DTYPE), w.to(fp8.FP8_DTYPE)
        one = torch.ones((), device=DEV)
        ms = do_bench_ms(lambda: torch._scaled_mm(xq, wq.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16,
                                                  use_fast_accum=True))
        rec.meta["fp8_TFLOPs"] = 2 * m * nn * kk / ms / 1e9
    except Exception as e:
        rec.meta["fp8_TFLOPs"] = None
        rec.meta["fp8_ceiling_error"] = f"{type(e).__name__}: {str(e)[:160]}"
    print(f"# ceilings: {rec.meta}", flush=True)


def make_router() -> Router:
    r = Router(SimpleNamespace(num_experts_per_tok=K, n_routed_experts=E, n_group=N_GROUP, topk_group=TOPK_GROUP,
                               norm_topk_prob=True, routed_scaling_factor=2.5, hidden_size=H)).to(DEV)
    g = torch.Generator(device=DEV).manual_seed(0)
    with torch.no_grad():
        r.weight.normal_(0.0, H**-0.5, generator=g)
        r.e_score_correction_bias.uniform_(0.0, 0.1, generator=g)
    return r


def make_weights() -> dict[str, tuple]:
    g = torch.Generator(device=DEV).manual_seed(1)
    gate_up = torch.empty(E, 2 * I, H, device=DEV, dtype=torch.bfloat16).normal_(0.0, H**-0.5, generator=g)
    down = torch.empty(E, H, I, device=DEV, dtype=torch.bfloat16).normal_(0.0, I**-0.5, generator=g)
    quantised = []
    for w in (gate_up, down):
        q = torch.empty_like(w, dtype=fp8.FP8_DTYPE)
        s = torch.empty(E, *fp8.block_scale_shape(w.shape[1], w.shape[2]), device=DEV)
        for e in range(E):  # one expert at a time: no fp32 copy of all of them
            q[e], s[e] = fp8.quant_block(w[e])
        quantised.append((q, s))
    (gu8, gus), (dn8, dns) = quantised
    return {"bf16": (gate_up, down, None, None), "fp8": (gu8, dn8, gus, dns)}


def routed(router: Router, num_tokens: int, seed: int):
    g = torch.Generator(device=DEV).manual_seed(seed)
    x = torch.randn(num_tokens, H, device=DEV, generator=g).bfloat16()
    with torch.no_grad():
        ids, weights = router(x)
    return x, ids, weights


def weight_bytes(params: tuple, experts: int) -> float:
    gate_up, down, gus, dns = params
    per_expert = (gate_up[0].numel() + down[0].numel()) * gate_up.element_size()
    if gus is not None:
        per_expert += (gus[0].numel() + dns[0].numel()) * 4
    return experts * per_expert


# ---------------------------------------------------------------------------
# DeepGEMM's grouped FP8 GEMMs (both GEMMs of the MoE only), guarded: any failure becomes a note


# DeepGEMM builds name the grouped GEMMs differently: the first name present is used.
GROUPED_NAMES = {"contiguous": ("m_grouped_fp8_gemm_nt_contiguous", "m_grouped_fp8_fp4_gemm_nt_contiguous"),
                 "masked": ("m_grouped_fp8_gemm_nt_masked", "fp8_m_grouped_gemm_nt_masked",
                            "m_grouped_fp8_fp4_gemm_nt_masked")}


def load_deep_gemm():
    """(namespace with .contiguous / .masked / .alignment(), version) or (None, why not)."""
    try:
        import types

        import deep_gemm

        fns = {}
        for kind, names in GROUPED_NAMES.items():
            found = next((getattr(deep_gemm, n) for n in names if callable(getattr(deep_gemm, n, None))), None)
            if found is None:
                raise AttributeError(f"deep_gemm has none of {', '.join(names)}")
            fns[kind] = found
        fns["alignment"] = deep_gemm.get_mk_alignment_for_contiguous_layout
        return types.SimpleNamespace(**fns), getattr(deep_gemm, "__version__", "imported")
    except Exception as e:
        return None, f"not used ({type(e).__name__}: {str(e)[:120]})"


def _fp8_act(rows: int, cols: int, lead: tuple = ()):
    a = torch.randn(*lead, rows, cols, device=DEV).to(fp8.FP8_DTYPE)
    return a, torch.rand(*lead, rows, cols // 128, device=DEV) * 0.01 + 0.001


def deepgemm_contiguous(dg, params: tuple, ids: torch.Tensor):
    """fn running DeepGEMM's two contiguous grouped GEMMs for this routing (rows padded per expert)."""
    gate_up, down, gus, dns = params
    align = int(dg.alignment())
    counts = torch.bincount(ids.flatten(), minlength=E)
    padded = (counts + align - 1) // align * align
    m_indices = torch.full((int(padded.sum()),), -1, dtype=torch.int32, device=DEV)
    starts = (padded.cumsum(0) - padded).tolist()
    for e, (s, c) in enumerate(zip(starts, counts.tolist())):
        m_indices[s:s + c] = e
    rows = m_indices.numel()
    a1, a2 = _fp8_act(rows, H), _fp8_act(rows, I)
    d1 = torch.empty(rows, 2 * I, device=DEV, dtype=torch.bfloat16)
    d2 = torch.empty(rows, H, device=DEV, dtype=torch.bfloat16)

    def fn():
        dg.contiguous(a1, (gate_up, gus), d1, m_indices)
        dg.contiguous(a2, (down, dns), d2, m_indices)
    return fn


def deepgemm_masked(dg, params: tuple, ids: torch.Tensor):
    """fn running DeepGEMM's two masked grouped GEMMs (decode layout: [E, max_m, K] per expert)."""
    gate_up, down, gus, dns = params
    counts = torch.bincount(ids.flatten(), minlength=E).int()
    max_m = max(64, -(-int(counts.max()) // 64) * 64)
    expected_m = max(1, -(-ids.numel() // E))
    a1, a2 = _fp8_act(max_m, H, (E,)), _fp8_act(max_m, I, (E,))
    d1 = torch.empty(E, max_m, 2 * I, device=DEV, dtype=torch.bfloat16)
    d2 = torch.empty(E, max_m, H, device=DEV, dtype=torch.bfloat16)

    def fn():
        dg.masked(a1, (gate_up, gus), d1, counts, expected_m)
        dg.masked(a2, (down, dns), d2, counts, expected_m)
    return fn


# ---------------------------------------------------------------------------


def bench_decode(rec: Recorder, router: Router, weights: dict, dg, sweep: bool) -> None:
    copy_bw = rec.meta["copy_GBps"]
    for kind, params in weights.items():
        for t in DECODE:
            x, ids, w = routed(router, t, seed=t)
            hit = int(ids.unique().numel())
            nbytes = weight_bytes(params, hit)
            base = dict(phase="decode", dtype=kind, T=t, experts_hit=hit, weight_MB=nbytes / 1e6)

            def add(impl: str, fn, note: str = "", graph: bool = True, reads_weights: bool = True):
                try:
                    ms = graph_ms(fn) if graph else do_bench_ms(fn)
                    gbs = nbytes / ms / 1e6 if reads_weights else None
                    rec.add(**base, impl=impl, us=ms * 1e3, **{"GB/s": gbs, "of_copy": gbs and gbs / copy_bw},
                            note=note)
                except Exception as e:
                    rec.add(**base, impl=impl, note=f"failed: {type(e).__name__}: {str(e).splitlines()[0][:140]}")

            cfg = fm.tile_config(t, K, E, params[0].dtype, x.dtype)
            add("fused", lambda: fm.fused_moe_triton(x, ids, w, *params), note=f"graph; tiles {_tiles(cfg)}")
            if kind == "bf16":  # the part of the op that sorts the pairs (the same for both dtypes)
                align = fm.align_for(ids.numel())
                add("fused: alignment only", lambda: align(ids, E, cfg.block_m), reads_weights=False,
                    note=f"graph; {align.__name__}")
            if kind == "fp8" and dg is not None:
                try:
                    fn = deepgemm_masked(dg, params, ids)
                except Exception as e:
                    rec.add(**base, impl="DeepGEMM masked", note=f"setup failed: {type(e).__name__}: {e}"[:160])
                else:
                    add("DeepGEMM masked (GEMMs only)", fn, note="graph")
            if sweep and t in (1, 32, 256):
                for alt in SWEEP["decode"]:
                    if kind == "bf16" or alt.block_k == 128:
                        add("fused (sweep)", lambda alt=alt: fm.fused_moe_triton(x, ids, w, *params, config=alt),
                            note=f"graph; tiles {_tiles(alt)}")
            torch.cuda.empty_cache()


def bench_prefill(rec: Recorder, router: Router, weights: dict, dg, sweep: bool) -> None:
    for kind, params in weights.items():
        ceiling = rec.meta["bf16_TFLOPs"] if kind == "bf16" else rec.meta.get("fp8_TFLOPs")
        for t in PREFILL:
            x, ids, w = routed(router, t, seed=t)
            flops = 6.0 * t * K * H * I
            base = dict(phase="prefill", dtype=kind, T=t, experts_hit=int(ids.unique().numel()))

            def add(impl: str, fn, note: str = ""):
                try:
                    ms = do_bench_ms(fn, rep=200)
                    tf = flops / ms / 1e9
                    rec.add(**base, impl=impl, us=ms * 1e3,
                            **{"TFLOP/s": tf, "of_mm": tf / ceiling if ceiling else None}, note=note)
                except Exception as e:
                    rec.add(**base, impl=impl, note=f"failed: {type(e).__name__}: {str(e).splitlines()[0][:140]}")

            cfg = fm.tile_config(min(t, fm.MAX_CHUNK_TOKENS), K, E, params[0].dtype, x.dtype)
            add("fused", lambda: fm.fused_moe_triton(x, ids, w, *params), note=f"tiles {_tiles(cfg)}")
            if kind == "fp8" and dg is not None:
                try:
                    fn = deepgemm_contiguous(dg, params, ids)
                except Exception as e:
                    rec.add(**base, impl="DeepGEMM contiguous", note=f"setup failed: {type(e).__name__}: {e}"[:160])
                else:
                    add("DeepGEMM contiguous (GEMMs only)", fn)
                # What the engine serves with DeepGEMM on: quantise, gather, both GEMMs, silu * up, combine.
                served = lambda: deepgemm.moe_contiguous(deepgemm.library(), x, ids, w, *params)  # noqa: E731
                add("DeepGEMM contiguous (served)", served,
                    note="served from T >= " + str(deepgemm.MOE_CONTIGUOUS_MIN_PAIRS_PER_EXPERT * E // K))
            if sweep and t in (2048, 8192):
                for alt in SWEEP["prefill"]:
                    add("fused (sweep)", lambda alt=alt: fm.fused_moe_triton(x, ids, w, *params, config=alt),
                        note=f"tiles {_tiles(alt)}")
            torch.cuda.empty_cache()


def _tiles(c: fm.TileConfig) -> str:
    return (f"M{c.block_m} N{c.block_n} K{c.block_k} G{c.group_m} w{c.num_warps} s{c.num_stages}"
            + (" split gate/up" if c.split_gate_up else ""))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", default=None, help="write the rows and ceilings here (JSON)")
    ap.add_argument("--markdown", default=None, help="write the table here (Markdown)")
    ap.add_argument("--sweep", action="store_true", help="also time a few other tile configs")
    ap.add_argument("--only", default="decode,prefill", help="comma list: decode, prefill")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench_moe: needs a CUDA GPU", file=sys.stderr)
        return 2
    t0 = time.time()
    rec = Recorder(args.json, args.markdown)
    commit = os.environ.get("MINIDSA_COMMIT", "")
    if not commit:
        try:
            commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                    text=True).stdout.strip()
        except OSError:
            pass
    dg, dg_status = load_deep_gemm()
    rec.meta.update(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                    date=datetime.date.today().isoformat(), commit=commit or "unknown", deep_gemm=dg_status)
    ceilings(rec)
    router, weights = make_router(), make_weights()
    print(f"# setup done in {time.time() - t0:.0f} s", flush=True)
    failed = []
    only = set(args.only.split(","))
    for name, fn in (("decode", bench_decode), ("prefill", bench_prefill)):
        if name not in only:
            continue
        try:
            fn(rec, router, weights, dg, args.sweep)
        except Exception:
            failed.append(name)
            traceback.print_exc()
    rec.meta["seconds"] = round(time.time() - t0, 1)
    rec.save()
    print()
    print(markdown(rec.meta, rec.rows))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
