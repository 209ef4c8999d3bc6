"""Issue 27 on the GPU: inter-token latency with and without a json_schema (structured outputs), batch 1 and 64,
one engine, one run. Target: at most 10% ITL overhead at batch 64.

Steady decode ITL, measured as bench_engine_loop.py measures it: the requests are added and stepped until every one
decodes, then `--decode-tokens` calls of `Engine.step` (the loop `LLM.generate` and the server run) are timed, in
ms per token of a request. Per batch size, the plain requests and the same requests with `response_format`
json_schema alternate (`--repeats` each, the median is reported) on the same engine, so start-up, graphs and
clocks are shared. The schema is a realistic one (records of strings, integers, enums, booleans, numbers and
arrays, strict) with no bound on the number of records, so the constrained rows keep decoding through the window.
The script checks that every request produced a token in every timed step.

With random weights the model writes random text inside the JSON strings, which is not what a trained model
writes. So the table also gives, per timed step, the host time of filling the masks (`fill_bitmask`, observed by
wrapping it) and a replay without the model: 64 grammar states fed realistic JSON documents token by token,
the mask fill time per step (one thread and `--grammar-threads`).

    python benchmarks/scripts/bench_structured.py --out /tmp/out [--model bench-dsv32] [--batches 1,64] [--temperature 1]
    (--allow-cpu: a smoke run on the tiny model without a GPU; its figures mean nothing)

Writes structured.json and structured.md under --out and prints the table.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time

import torch

RECORD = {"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer"}, "email": {"type": "string"},
    "active": {"type": "boolean"}, "role": {"enum": ["admin", "user", "guest"]}, "score": {"type": "number"},
    "tags": {"type": "array", "items": {"type": "string"}}},
    "required": ["name", "age", "email", "active", "role", "score", "tags"], "additionalProperties": False}
# minItems: random weights would otherwise close the array within the timed window (the first H100 run did)
SCHEMA = {"type": "object", "properties": {"records": {"type": "array", "items": RECORD, "minItems": 64}},
          "required": ["records"], "additionalProperties": False}
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "records", "schema": SCHEMA, "strict": True}}


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1000, vocab - 1, (n, length), generator=g).tolist()


class FillTimer:
    """Host time of StructuredOutputs.fill_bitmask calls while on (wraps the class method; observe only)."""

    def __init__(self):
        from minidsa.chat.grammar import StructuredOutputs

        self.on, self.times = False, []
        inner = StructuredOutputs.fill_bitmask

        def timed(obj, states, bitmask):
            start = time.perf_counter()
            inner(obj, states, bitmask)
            if self.on:
                self.times.append(time.perf_counter() - start)

        StructuredOutputs.fill_bitmask = timed


def steady_itl(engine, prompts, decode_tokens: int, temperature: float, structured: bool, timer: FillTimer) -> dict:
    """ms per token of a request over `decode_tokens` steady steps, and the mask fill time of those steps."""
    from minidsa import SamplingParams

    params = [SamplingParams(max_tokens=4 * decode_tokens + 256, ignore_eos=True, detokenize=False,
                             temperature=temperature, seed=i if temperature else None,
                             response_format=RESPONSE_FORMAT if structured else None) for i in range(len(prompts))]
    ids = [engine.add_request(p, sp, use_prefix_cache=False) for p, sp in zip(prompts, params)]
    got = dict.fromkeys(ids, 0)
    while min(got.values()) < 3:  # every request decoding; overlap's step in flight is a decode step too
        for o in engine.step():
            got[o.request_id] += len(o.new_token_ids)
    counts = dict.fromkeys(ids, 0)
    timer.times, timer.on = [], True
    _sync()
    start = time.perf_counter()
    for _ in range(decode_tokens):
        for o in engine.step():
            counts[o.request_id] += len(o.new_token_ids)
            assert not o.finished, f"{o.request_id} finished ({o.finish_reason}) inside the timed window"
    elapsed = time.perf_counter() - start
    timer.on = False
    for rid in ids:
        engine.abort(rid, report=False)
    while engine.has_unfinished():
        engine.step()
    engine.check_no_leaks()
    per_request = sum(counts.values()) / len(ids)
    assert min(counts.values()) >= decode_tokens - 1, counts  # a token per step (overlap: one step later)
    fill = timer.times
    return {"itl_ms": elapsed / per_request * 1e3,
            "fill_ms_per_step": statistics.mean(fill) * 1e3 if fill else 0.0,
            "fill_ms_p99": sorted(fill)[int(0.99 * (len(fill) - 1))] * 1e3 if fill else 0.0}


def _record(rng: random.Random, i: int) -> dict:
    words = ("alice bob carol engineer designer lives near the river and likes green tea on sunday morning "
             "data model ships fast").split()
    return {"name": " ".join(rng.choice(words) for _ in range(2)).title(), "age": rng.randint(18, 90),
            "email": f"user{i}@example.com", "active": rng.random() < 0.5,
            "role": rng.choice(["admin", "user", "guest"]),
            "score": round(rng.random() * 100, 2), "tags": [rng.choice(words) for _ in range(rng.randint(0, 3))]}


def replay_fill(engine, rows: int, steps: int, threads: int) -> dict:
    """Mask fill time per step of `rows` grammar states walking realistic documents (no model, no GPU)."""
    structured = engine._structured  # built by the constrained requests above
    from minidsa.chat.grammar import parse_response_format

    fmt = parse_response_format(RESPONSE_FORMAT)
    rng = random.Random(0)
    docs = [engine.tokenizer.encode(json.dumps({"records": [_record(rng, i * 100 + j) for j in range(40)]}),
                                    add_special_tokens=False) for i in range(rows)]
    states = [structured.new_state(fmt) for _ in range(rows)]
    bitmask = structured.allocate_bitmask(rows)
    saved, structured.fill_threads = structured.fill_threads, threads
    times = []
    try:
        for step in range(min(steps, min(len(d) for d in docs))):
            start = time.perf_counter()
            structured.fill_bitmask(states, bitmask)
            times.append(time.perf_counter() - start)
            for s, d in zip(states, docs):
                assert s.accept([d[step]]) == 1
    finally:
        structured.fill_threads = saved
    times.sort()
    return {"rows": rows, "threads": threads, "steps": len(times), "fill_ms_mean": statistics.mean(times) * 1e3,
            "fill_ms_p50": times[len(times) // 2] * 1e3, "fill_ms_p99": times[int(0.99 * (len(times) - 1))] * 1e3}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="bench-dsv32", help="preset or checkpoint (default: bench-dsv32)")
    p.add_argument("--out", default=".", help="folder for structured.json / structured.md")
    p.add_argument("--batches", default="1,64", help="decode batch sizes")
    p.add_argument("--context", type=int, default=512, help="prompt length")
    p.add_argument("--decode-tokens", type=int, default=64, help="decode steps timed per measurement")
    p.add_argument("--repeats", type=int, default=3, help="measurements per (batch, plain / schema): the median")
    p.add_argument("--temperature", type=float, default=1.0, help="of the requests (the server's default is 1)")
    p.add_argument("--grammar-threads", type=int, default=max(1, min(8, (os.cpu_count() or 2) // 2)),
                   help="threads of the replay's second mask-fill figure")
    p.add_argument("--disable-compile", action="store_true", help="graphs of the plain modules (faster start-up)")
    p.add_argument("--allow-cpu", action="store_true", help="run without a GPU (a smoke run of this script)")
    args = p.parse_args(argv)
    if not torch.cuda.is_available() and not args.allow_cpu:
        p.error("needs a CUDA GPU (--allow-cpu for a smoke run)")
    batches = [int(b) for b in args.batches.split(",")]
    os.makedirs(args.out, exist_ok=True)
    from minidsa import LLM

    model = args.model if torch.cuda.is_available() else None
    llm = LLM(model=model, progress=False, enable_prefix_caching=False, max_running_requests=max(batches),
              cuda_graph_max_bs=max(batches), enable_compile=not args.disable_compile)
    engine = llm.engine
    timer = FillTimer()
    rows, seed = [], 0
    for bs in batches:
        for structured in (False, True):  # warm-up at this size, both ways
            steady_itl(engine, _prompts(bs, args.context, engine.vocab_size, seed := seed + 1), 4, args.temperature,
                       structured, timer)
        runs: dict[bool, list[dict]] = {False: [], True: []}
        for _ in range(args.repeats):
            for structured in (False, True):
                runs[structured].append(steady_itl(engine, _prompts(bs, args.context, engine.vocab_size,
                                                                    seed := seed + 1),
                                                   args.decode_tokens, args.temperature, structured, timer))
        plain = statistics.median(r["itl_ms"] for r in runs[False])
        schema = statistics.median(r["itl_ms"] for r in runs[True])
        row = {"batch": bs, "context": args.context, "temperature": args.temperature, "itl_plain_ms": plain,
               "itl_schema_ms": schema, "overhead": schema / plain - 1,
               "fill_ms_per_step": statistics.median(r["fill_ms_per_step"] for r in runs[True]),
               "fill_ms_p99": max(r["fill_ms_p99"] for r in runs[True]),
               "runs": {"plain": runs[False], "schema": runs[True]}}
        rows.append(row)
        print(f"batch {bs}: ITL plain {plain:.3f} ms, json_schema {schema:.3f} ms ({row['overhead']:+.1%}); "
              f"mask fill {row['fill_ms_per_step']:.3f} ms per step (p99 {row['fill_ms_p99']:.3f})", flush=True)
    replay = [replay_fill(engine, max(batches), 256, t) for t in sorted({1, args.grammar_threads})]
    for r in replay:
        print(f"replay of realistic JSON, {r['rows']} rows, {r['threads']} thread(s): mask fill "
              f"{r['fill_ms_mean']:.3f} ms per step (p50 {r['fill_ms_p50']:.3f}, p99 {r['fill_ms_p99']:.3f})", flush=True)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    result = {"model": engine.model_name, "device": device, "commit": os.environ.get("MINIDSA_COMMIT"),
              "decode_tokens": args.decode_tokens, "repeats": args.repeats, "schema": SCHEMA, "rows": rows,
              "replay": replay}
    with open(os.path.join(args.out, "structured.json"), "w") as f:
        json.dump(result, f, indent=1)
    lines = [f"Structured outputs: steady decode ITL, {engine.model_name} on {device}, context {args.context}, "
             f"temperature {args.temperature}, median of {args.repeats} x {args.decode_tokens} steps",
             "",
             "| batch | ITL plain (ms) | ITL json_schema (ms) | overhead | mask fill per step (ms) | fill p99 (ms) |",
             "|---|---|---|---|---|---|"]
    lines += [f"| {r['batch']} | {r['itl_plain_ms']:.3f} | {r['itl_schema_ms']:.3f} | {r['overhead']:+.1%} | "
              f"{r['fill_ms_per_step']:.3f} | {r['fill_ms_p99']:.3f} |" for r in rows]
    lines += ["", "Mask fill without the model, realistic JSON documents:", "",
              "| rows | threads | mean (ms) | p50 (ms) | p99 (ms) |", "|---|---|---|---|---|"]
    lines += [f"| {r['rows']} | {r['threads']} | {r['fill_ms_mean']:.3f} | {r['fill_ms_p50']:.3f} | "
              f"{r['fill_ms_p99']:.3f} |" for r in replay]
    with open(os.path.join(args.out, "structured.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines), flush=True)
    llm.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
