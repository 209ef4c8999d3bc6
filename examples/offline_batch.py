"""Offline batch generation with the Python API, timed.

    python examples/offline_batch.py                               # embedded tiny model
    python examples/offline_batch.py --model /path/to/checkpoint --num-prompts 64 --max-tokens 128

All prompts go to `LLM.generate` at once: the scheduler prefills them and
then decodes them together, one forward per step for the whole batch. For
comparison the same prompts are then run one request at a time
(`--no-sequential` skips that).
"""

from __future__ import annotations

import argparse
import time

from minidsa import LLM, SamplingParams

PROMPTS = [
    "The capital of France is",
    "Sparse attention lets a model",
    "Write a haiku about GPUs:",
    "def fibonacci(n):",
    "The three laws of thermodynamics are",
    "Once upon a time, in a small village,",
    "Translate to German: good morning",
    "The best way to learn a language is",
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="checkpoint directory or preset (default: embedded tiny model)")
    ap.add_argument("--num-prompts", type=int, default=8, help="prompts in the batch (cycled from a fixed list)")
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--seed", type=int, default=0, help="sampling seed of prompt i is seed + i")
    ap.add_argument("--no-sequential", action="store_true", help="skip the one-request-at-a-time comparison")
    args = ap.parse_args()
    if args.num_prompts < 1:
        ap.error("--num-prompts must be >= 1")

    t0 = time.perf_counter()
    llm = LLM(model=args.model, progress=False)
    print(f"loaded {llm.engine.model_name} in {time.perf_counter() - t0:.1f} s: {llm}")

    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(args.num_prompts)]
    # ignore_eos: every request generates exactly max_tokens, so the timings compare equal work.
    params = [SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed + i,
                             ignore_eos=True) for i in range(len(prompts))]
    llm.generate(prompts[0], SamplingParams(max_tokens=2))  # warm-up: first-call costs stay out of the timing

    t0 = time.perf_counter()
    outputs = llm.generate(prompts, params)
    batched_s = time.perf_counter() - t0
    for prompt, out in zip(prompts, outputs):
        print(f"{prompt!r} -> {out.text!r} [{out.finish_reason}]")
    n_tokens = sum(len(o.token_ids) for o in outputs)
    print(f"batched:    {len(prompts)} requests, {n_tokens} tokens in {batched_s:.2f} s "
          f"= {n_tokens / batched_s:.1f} tok/s")

    if not args.no_sequential:
        t0 = time.perf_counter()
        one_by_one = [llm.generate(p, sp)[0] for p, sp in zip(prompts, params)]
        sequential_s = time.perf_counter() - t0
        print(f"sequential: {len(prompts)} requests, {n_tokens} tokens in {sequential_s:.2f} s "
              f"= {n_tokens / sequential_s:.1f} tok/s (batching: {sequential_s / batched_s:.1f}x)")
        if args.temperature == 0.0:  # greedy: batching must not change a single token
            same = sum(a.token_ids == b.token_ids for a, b in zip(outputs, one_by_one))
            print(f"greedy outputs identical batched vs sequential: {same}/{len(prompts)}")
    m = llm.engine.metrics()
    print(f"engine: {m.requests_finished_total} requests finished, {m.generation_tokens_total} tokens generated, "
          f"KV in use {m.kv_used_tokens}/{m.kv_total_tokens}")


if __name__ == "__main__":
    main()
