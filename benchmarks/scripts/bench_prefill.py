"""Prefill throughput and MFU on a real-shape preset (one GPU, one run): `LLM.generate(prompt, max_tokens=1)`.

    PYTHONPATH=. python3 benchmarks/scripts/bench_prefill.py --model bench-dsv32:4 --prompts 8192 32768 --out $OUT

Each prompt length is timed after a warm-up prompt of the same length (Triton / DeepGEMM JIT paid there), with
the prefix cache off, as the median of `--repeats` prompts (min and max kept in the JSON), once per `--modes`:
"compiled" (the default engine: prefill chunks run the torch.compile'd decoder layer) and "eager"
(`enable_compile=False`: the plain modules), one engine after the other, side by side in one table with each
mode's peak memory above the weights and caches (the activations of a chunk).
FLOPs counted: the matmuls a token actually runs (attention projections, indexer, the dense MLPs, the 8 chosen +
shared experts of each MoE layer, lm_head for the last token only) plus sparse attention (min(top-k, position)
keys) and indexer scoring (every causal key). MFU against the FP8 matmul ceiling (torch._scaled_mm) and the bf16
one measured in the same run.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time

import torch


def flops_per_prompt(cfg, n: int) -> float:
    h = cfg.hidden_size
    heads = cfg.num_attention_heads
    attn_proj = (h * (cfg.q_lora_rank + cfg.kv_lora_rank + cfg.qk_rope_head_dim)
                 + cfg.q_lora_rank * heads * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim)
                 + heads * cfg.qk_nope_head_dim * cfg.kv_lora_rank  # absorbed q_nope -> latent
                 + heads * cfg.kv_lora_rank * cfg.v_head_dim  # latent -> v
                 + heads * cfg.v_head_dim * h)
    indexer_proj = cfg.q_lora_rank * cfg.index_n_heads * cfg.index_head_dim + h * cfg.index_head_dim \
        + h * cfg.index_n_heads
    expert = 3 * h * cfg.moe_intermediate_size
    per_token = 0.0
    for i in range(cfg.num_hidden_layers):
        per_token += attn_proj + (indexer_proj if cfg.indexer_full[i] else 0)
        if cfg.dense_layers[i]:
            per_token += 3 * h * cfg.intermediate_size
        else:
            per_token += (cfg.num_experts_per_tok + cfg.n_shared_experts) * expert + h * cfg.n_routed_experts
    total = 2.0 * per_token * n
    # Attention over the selected keys (576-dim scores, 512-dim values per head) and indexer scoring.
    kv_dim = cfg.kv_lora_rank + cfg.qk_rope_head_dim
    keys = sum(min(cfg.index_topk, p + 1) for p in range(0, n, 64)) * 64
    total += 2.0 * cfg.num_hidden_layers * heads * (kv_dim + cfg.kv_lora_rank) * keys
    total += 2.0 * sum(cfg.indexer_full) * cfg.index_n_heads * cfg.index_head_dim * (n * (n + 1) / 2)
    total += 2.0 * h * cfg.vocab_size  # lm_head, last token
    return total


def ceilings(dev) -> dict:
    a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)

    def timed(fn, iters=10):
        fn()
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
        return (time.perf_counter() - t) / iters

    out = {"bf16_TFLOPs": 2 * 8192**3 / timed(lambda: a @ b) / 1e12}
    a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn).t()
    one = torch.ones((), device=dev)
    out["fp8_TFLOPs"] = 2 * 8192**3 / timed(lambda: torch._scaled_mm(a8, b8, one, one, out_dtype=torch.bfloat16)) / 1e12
    return out


def measure(args, mode: str, ceil: dict | None) -> tuple[list[dict], dict, object]:
    """Rows for every prompt length with one engine in `mode` ("compiled" | "eager"); the ceilings (measured with
    the first engine) and its model config."""
    import gc

    from minidsa import LLM, SamplingParams

    longest = max(args.prompts)
    llm = LLM(model=args.model, progress=False, max_running_requests=2, enable_prefix_caching=False,
              max_total_tokens=2 * longest + 1024, max_model_len=longest + 64,
              chunked_prefill_size=args.chunked_prefill_size, max_prefill_tokens=args.chunked_prefill_size,
              cuda_graph_max_bs=2, enable_compile=mode == "compiled")
    cfg = llm.engine.model_config
    dev = llm.engine.runner.device
    ceil = ceil or ceilings(dev)
    one = SamplingParams(max_tokens=1, ignore_eos=True, detokenize=False)
    g = torch.Generator().manual_seed(0)
    rows = []
    for n in args.prompts:
        prompt = torch.randint(1000, 100000, (n,), generator=g).tolist()
        llm.generate([torch.randint(1000, 100000, (n,), generator=g).tolist()], one)  # warm-up: JIT, allocator
        torch.cuda.synchronize()
        resident = torch.cuda.memory_allocated(dev)  # weights, caches, graphs' static buffers
        torch.cuda.reset_peak_memory_stats(dev)
        times = []
        for _ in range(args.repeats):  # the same prompt each time: the prefix cache is off
            t = time.perf_counter()
            llm.generate([prompt], one)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t)
        sec = sorted(times)[len(times) // 2]
        fl = flops_per_prompt(cfg, n)
        row = {"mode": mode, "prompt": n, "seconds": sec, "seconds_min": min(times), "seconds_max": max(times),
               "repeats": len(times), "tok_per_s": n / sec, "TFLOPs": fl / sec / 1e12,
               "MFU_fp8": fl / sec / 1e12 / ceil["fp8_TFLOPs"], "MFU_bf16": fl / sec / 1e12 / ceil["bf16_TFLOPs"],
               "peak_activation_GiB": (torch.cuda.max_memory_allocated(dev) - resident) / 2**30}
        rows.append(row)
        print(json.dumps(row), flush=True)
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    return rows, ceil, cfg


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="bench-dsv32:4")
    ap.add_argument("--prompts", type=int, nargs="+", default=[8192, 32768])
    ap.add_argument("--chunked-prefill-size", type=int, default=8192)
    ap.add_argument("--modes", nargs="+", choices=["compiled", "eager"], default=["compiled", "eager"],
                    help="prefill through the compiled decoder layer and / or the plain modules, one engine each")
    ap.add_argument("--repeats", type=int, default=5,
                    help="timed prompts per length, the median reported (one prompt varied by 5-10%% run to run)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    rows, ceil, cfg = [], None, None
    for mode in args.modes:
        got, ceil, cfg = measure(args, mode, ceil)
        rows += got
    commit = os.environ.get("MINIDSA_COMMIT") or subprocess.run(["git", "rev-parse", "--short", "HEAD"],
                                                                capture_output=True, text=True).stdout.strip()
    meta = dict(device=torch.cuda.get_device_name(), date=datetime.date.today().isoformat(), commit=commit,
                model=args.model, layers=cfg.num_hidden_layers, chunked_prefill_size=args.chunked_prefill_size,
                argv=" ".join(sys.argv), **ceil)
    print(f"\nPrefill, {meta['model']} ({meta['layers']} layers), {meta['device']}, {meta['date']}, commit {commit}; "
          f"chunks of {args.chunked_prefill_size}; ceilings bf16 {ceil['bf16_TFLOPs']:.0f} / fp8 "
          f"{ceil['fp8_TFLOPs']:.0f} TFLOP/s\n")
    print("| prompt | mode | s | tok/s | TFLOP/s | MFU (fp8 ceiling) | MFU (bf16 ceiling) | peak activations GiB |\n"
          "|---|---|---|---|---|---|---|---|")
    by_key = {(r["prompt"], r["mode"]): r for r in rows}
    for n in args.prompts:
        for mode in args.modes:
            r = by_key[(n, mode)]
            print(f"| {n} | {mode} | {r['seconds']:.3f} | {r['tok_per_s']:.0f} | {r['TFLOPs']:.0f} | "
                  f"{r['MFU_fp8']:.1%} | {r['MFU_bf16']:.1%} | {r['peak_activation_GiB']:.2f} |")
        if len(args.modes) == 2:
            c, e = by_key[(n, "compiled")], by_key[(n, "eager")]
            print(f"| {n} | compiled / eager | | {c['tok_per_s'] / e['tok_per_s']:.2f}x | | | | "
                  f"{c['peak_activation_GiB'] / max(e['peak_activation_GiB'], 1e-9):.2f}x |")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "prefill.json"), "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
