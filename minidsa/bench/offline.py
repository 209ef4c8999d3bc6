"""Offline throughput benchmark (`minidsa bench`).

Synthetic workload like nano-vllm's: `num_requests` prompts of random token
ids, input and output lengths uniform in [min, max] (default 256 requests,
100-1024 each, seed 0), all submitted at t=0, greedy, ignore_eos so every
request generates exactly its output length. Reports requests/s, input /
output tokens/s, and TTFT / inter-token-latency percentiles; `--json`
writes everything, `--plot` draws throughput and latency (needs matplotlib).

On CPU the default workload is scaled down (16 requests, 100-512 in,
32-128 out) unless the sizes are given explicitly.

`--workload shared-prefix`: every prompt is one system prompt (2048 tokens
by default, `--shared-prefix-len`) followed by a short question (16-64
tokens, `--input-len`), outputs 64-256 tokens (16-32 on CPU). With the prefix
cache on, the same workload runs twice on the same engine: with the cache,
then without it (those requests neither reuse nor add cached pages); the
summary reports the cache hit rate and the TTFT of both runs.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import platform
import random
import subprocess
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from minidsa.common.request import SamplingParams
from minidsa.engine import Engine

GPU_DEFAULTS = {"num_requests": 256, "input_len": (100, 1024), "output_len": (100, 1024)}
CPU_DEFAULTS = {"num_requests": 16, "input_len": (100, 512), "output_len": (32, 128)}
# shared-prefix workload: input_len is the question after the shared system prompt
SHARED_GPU_DEFAULTS = {"num_requests": 256, "input_len": (16, 64), "output_len": (64, 256)}
SHARED_CPU_DEFAULTS = {"num_requests": 16, "input_len": (16, 64), "output_len": (16, 32)}
SHARED_PREFIX_LEN = 2048
WORKLOADS = ("random", "shared-prefix")
PERCENTILES = (50, 90, 99)


@dataclass
class Workload:
    num_requests: int
    input_len: tuple[int, int]
    output_len: tuple[int, int]
    seed: int = 0
    shared_prefix_len: int = 0  # shared-prefix workload: length of the system prompt every prompt starts with
    prompts: list[list[int]] = field(default_factory=list)
    output_lens: list[int] = field(default_factory=list)

    @classmethod
    def synthetic(cls, num_requests: int, input_len: tuple[int, int], output_len: tuple[int, int], seed: int,
                  vocab_size: int, max_model_len: int) -> "Workload":
        for name, (lo, hi) in (("input_len", input_len), ("output_len", output_len)):
            if not 1 <= lo <= hi:
                raise ValueError(f"{name} range must satisfy 1 <= min <= max, got {lo}-{hi}")
        if num_requests < 1:
            raise ValueError(f"num_requests must be >= 1, got {num_requests}")
        if input_len[1] + output_len[1] > max_model_len:
            raise ValueError(f"input_len max {input_len[1]} + output_len max {output_len[1]} exceeds "
                             f"max_model_len {max_model_len} (raise --max-total-tokens or lower the lengths)")
        rng = random.Random(seed)
        # Ordinary token ids only: skip the lowest ids (specials on DeepSeek tokenizers) and the tail.
        lo_id, hi_id = min(1000, vocab_size // 4), min(vocab_size, 100000) - 1
        w = cls(num_requests, input_len, output_len, seed)
        for _ in range(num_requests):
            n = rng.randint(*input_len)
            w.prompts.append([rng.randint(lo_id, hi_id) for _ in range(n)])
            w.output_lens.append(rng.randint(*output_len))
        return w

    @classmethod
    def shared_prefix(cls, num_requests: int, prefix_len: int, question_len: tuple[int, int],
                      output_len: tuple[int, int], seed: int, vocab_size: int, max_model_len: int) -> "Workload":
        """One system prompt of `prefix_len` random tokens, then a random question per request."""
        if prefix_len < 1:
            raise ValueError(f"shared prefix length must be >= 1, got {prefix_len}")
        w = cls.synthetic(num_requests, (question_len[0] + prefix_len, question_len[1] + prefix_len), output_len,
                          seed, vocab_size, max_model_len)
        rng = random.Random(seed ^ 0x5EED)
        lo_id, hi_id = min(1000, vocab_size // 4), min(vocab_size, 100000) - 1
        system = [rng.randint(lo_id, hi_id) for _ in range(prefix_len)]
        w.prompts = [system + p[prefix_len:] for p in w.prompts]
        w.input_len, w.shared_prefix_len = question_len, prefix_len
        return w


def _percentiles(xs: list[float]) -> dict[str, float]:
    if not xs:
        return {"mean": float("nan"), **{f"p{p}": float("nan") for p in PERCENTILES}}
    t = torch.tensor(xs, dtype=torch.float64)
    out = {"mean": float(t.mean())}
    for p in PERCENTILES:
        out[f"p{p}"] = float(torch.quantile(t, p / 100))
    return out


def run_workload(engine: Engine, w: Workload, progress: bool = True, use_prefix_cache: bool = True
                 ) -> dict[str, Any]:
    """Submit everything at t=0, step until done; per-request and per-step timings."""
    from tqdm.auto import tqdm

    before = engine.metrics()
    start = time.perf_counter()
    ids = []
    for prompt, n in zip(w.prompts, w.output_lens):
        params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, detokenize=False)
        ids.append(engine.add_request(prompt, params, use_prefix_cache=use_prefix_cache))
    index = {rid: i for i, rid in enumerate(ids)}
    first = [None] * len(ids)
    last = [start] * len(ids)
    itl: list[float] = []
    steps: list[tuple[float, int, int]] = []  # (seconds since start, tokens emitted, prompt tokens done)
    done = 0
    bar = tqdm(total=sum(w.output_lens), desc="bench", unit="tok", disable=not progress)
    while engine.has_unfinished():
        outs = engine.step()
        t = time.perf_counter()
        emitted = 0
        for o in outs:
            i = index.get(o.request_id)
            if i is None or not o.new_token_ids:
                continue
            k = len(o.new_token_ids)
            emitted += k
            if first[i] is None:
                first[i] = t
                k -= 1  # the first token's latency is TTFT, not ITL
            if k > 0:
                itl.extend([(t - last[i]) / k] * k)  # several tokens in one step share its latency
            last[i] = t
            if o.finished:
                done += 1
        steps.append((t - start, emitted, done))
        bar.update(emitted)
    bar.close()
    duration = time.perf_counter() - start
    ttft = [f - start for f in first if f is not None]
    in_tok, out_tok = sum(len(p) for p in w.prompts), sum(w.output_lens)
    after = engine.metrics()
    query = after.prefix_cache_query_tokens_total - before.prefix_cache_query_tokens_total
    hits = after.prefix_cache_hit_tokens_total - before.prefix_cache_hit_tokens_total
    return {
        "duration_s": duration,
        "num_requests": len(ids),
        **throughput(duration, len(ids), in_tok, out_tok),
        "ttft_s": _percentiles(ttft),
        "itl_s": _percentiles(itl),
        "num_steps": len(steps),
        "preemptions": after.preemptions_total - before.preemptions_total,
        "speculative": _speculative_summary(engine, before, after),
        "prefix_cache": {
            "enabled": engine.prefix_cache is not None,
            "query_tokens": query,  # prompt tokens looked up at admission (re-admissions after preemption too)
            "hit_tokens": hits,  # of which came from the cache instead of prefill
            "hit_rate": hits / query if query else 0.0,
            "cached_tokens": after.prefix_cache_tokens,  # KV token slots the cache holds at the end
        },
        "timeline": steps,
    }


def _speculative_summary(engine: Engine, before: Any, after: Any) -> dict[str, Any] | None:
    """Tokens per speculative round over the run (None without speculation); `simulated` says when the acceptance
    was the benchmark-only simulation, not the model's."""
    if engine.speculator is None:
        return None
    rounds = after.spec_verify_steps_total - before.spec_verify_steps_total
    accepted = after.spec_accepted_tokens_total - before.spec_accepted_tokens_total
    return {"rounds": rounds, "tokens_per_round": (accepted + rounds) / rounds if rounds else 0.0,
            "simulated_accept_len": after.spec_simulated_accept_len or None}


def git_commit() -> str | None:
    """The commit measured: MINIDSA_COMMIT where set (the GPU machine's copy of a tree may carry another tree's .git
    or none), else git's HEAD of this tree."""
    if os.environ.get("MINIDSA_COMMIT"):
        return os.environ["MINIDSA_COMMIT"]
    try:
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True,
                              timeout=5).stdout.strip() or None
    except Exception:
        return None


def describe_device(engine: Engine) -> str:
    dev = engine.runner.device
    if dev.type == "cuda":
        return torch.cuda.get_device_name(dev)
    return f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"


def print_summary(result: dict[str, Any]) -> None:
    r = result["results"]
    rows = [
        ("model", result["model"]),
        ("device", result["device"]),
        ("requests", f"{r['num_requests']}  (in {r['input_tokens']} tok, out {r['output_tokens']} tok)"),
        ("duration", f"{r['duration_s']:.2f} s  ({r['num_steps']} steps, {r['preemptions']} preemptions)"),
        ("requests/s", f"{r['requests_per_s']:.2f}"),
        ("input tokens/s", f"{r['input_tokens_per_s']:.1f}"),
        ("output tokens/s", f"{r['output_tokens_per_s']:.1f}"),
        ("total tokens/s", f"{r['total_tokens_per_s']:.1f}"),
    ]
    pc = r.get("prefix_cache")
    if pc is not None:
        rows.append(("prefix cache", "off" if not pc["enabled"] else
                     f"hit rate {pc['hit_rate'] * 100:.1f}%  ({pc['hit_tokens']} of {pc['query_tokens']} prompt "
                     f"tokens from the cache; it holds {pc['cached_tokens']} tokens)"))
    spec = r.get("speculative")
    if spec is not None:
        sim = spec["simulated_accept_len"]
        rows.append(("speculative", f"{spec['tokens_per_round']:.2f} tokens per round over {spec['rounds']} rounds"
                     + (f"  (SIMULATED acceptance {sim:g}: not the model's output)" if sim else "")))
    for name, key in (("TTFT", "ttft_s"), ("ITL", "itl_s")):
        s = r[key]
        rows.append((f"{name} ms (mean/p50/p90/p99)",
                     " / ".join(f"{s[k] * 1e3:.1f}" for k in ("mean", "p50", "p90", "p99"))))
    base = r.get("without_prefix_cache")
    if base is not None:
        s = base["ttft_s"]
        rows.append(("TTFT ms without the cache", " / ".join(f"{s[k] * 1e3:.1f}" for k in ("mean", "p50", "p90", "p99"))
                     + f"  (same workload, {base['duration_s']:.2f} s)"))
    width = max(len(k) for k, _ in rows)
    print("-" * (width + 40))
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    print("-" * (width + 40))


def plot_result(result: dict[str, Any], path: str) -> str:
    """Output throughput over time and the TTFT/ITL percentiles, as a PNG."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise RuntimeError("--plot needs matplotlib (pip install matplotlib)") from e
    r = result["results"]
    tl = r["timeline"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    if tl:
        times = [t for t, _, _ in tl]
        window = max(1, len(tl) // 50)
        rates, mids = [], []
        for i in range(0, len(tl), window):
            chunk = tl[i:i + window]
            t0 = tl[i - 1][0] if i else 0.0
            dt = chunk[-1][0] - t0
            rates.append(sum(c[1] for c in chunk) / dt if dt > 0 else 0.0)
            mids.append((t0 + chunk[-1][0]) / 2)
        ax1.plot(mids, rates)
        ax1.set_xlim(0, times[-1])
    ax1.set_xlabel("time (s)")
    ax1.set_ylabel("output tokens/s")
    ax1.set_title(f"{result['model']} on {result['device']}")
    labels = ["mean"] + [f"p{p}" for p in PERCENTILES]
    x = range(len(labels))
    ax2.bar([i - 0.2 for i in x], [r["ttft_s"][k] * 1e3 for k in labels], width=0.4, label="TTFT")
    ax2.bar([i + 0.2 for i in x], [r["itl_s"][k] * 1e3 for k in labels], width=0.4, label="ITL")
    ax2.set_xticks(list(x), labels)
    ax2.set_yscale("log")
    ax2.set_ylabel("ms")
    ax2.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def throughput(duration: float, completed: int, in_tok: int, out_tok: int) -> dict[str, float]:
    """Token counts and rates of a run (offline and online bench alike)."""
    return {
        "input_tokens": in_tok,
        "output_tokens": out_tok,
        "requests_per_s": completed / duration,
        "input_tokens_per_s": in_tok / duration,
        "output_tokens_per_s": out_tok / duration,
        "total_tokens_per_s": (in_tok + out_tok) / duration,
    }


def make_workload(workload: str, num_requests: int | None, input_len: tuple[int, int] | None,
                  output_len: tuple[int, int] | None, seed: int, shared_prefix_len: int | None, gpu: bool,
                  vocab_size: int, max_model_len: int) -> Workload:
    """The benchmark's workload; sizes left None take the device's defaults (offline and online bench alike)."""
    if workload not in WORKLOADS:
        raise ValueError(f"workload must be one of {', '.join(WORKLOADS)}, got {workload!r}")
    shared = workload == "shared-prefix"
    defaults = (SHARED_GPU_DEFAULTS if gpu else SHARED_CPU_DEFAULTS) if shared else \
        (GPU_DEFAULTS if gpu else CPU_DEFAULTS)
    num_requests = num_requests or defaults["num_requests"]
    input_len = input_len or defaults["input_len"]
    output_len = output_len or defaults["output_len"]
    if shared:
        return Workload.shared_prefix(num_requests, shared_prefix_len or SHARED_PREFIX_LEN, input_len, output_len,
                                      seed, vocab_size, max_model_len)
    return Workload.synthetic(num_requests, input_len, output_len, seed, vocab_size, max_model_len)


def run_bench(engine: Engine, num_requests: int | None = None, input_len: tuple[int, int] | None = None,
              output_len: tuple[int, int] | None = None, seed: int = 0, warmup: bool = True,
              progress: bool = True, workload: str = "random", shared_prefix_len: int | None = None) -> dict[str, Any]:
    """Run the benchmark on an engine; sizes left None take the device's defaults.

    workload "random": independent random prompts; "shared-prefix": one system prompt of `shared_prefix_len`
    tokens (default 2048) + a question of `input_len` tokens per request.
    """
    gpu = engine.runner.device.type == "cuda"
    w = make_workload(workload, num_requests, input_len, output_len, seed, shared_prefix_len, gpu,
                      engine.vocab_size, engine.max_model_len)
    shared = workload == "shared-prefix"
    if warmup:  # first-call costs (allocator, kernels' autotuning) stay out of the numbers
        run_workload(engine, Workload.synthetic(2, (16, 64), (4, 8), seed + 1, engine.vocab_size,
                                                engine.max_model_len), progress=False)
    results = run_workload(engine, w, progress=progress)
    if shared and engine.prefix_cache is not None:  # the same workload without the cache, for comparison
        baseline = run_workload(engine, w, progress=progress, use_prefix_cache=False)
        results["without_prefix_cache"] = {k: baseline[k] for k in (
            "duration_s", "requests_per_s", "output_tokens_per_s", "total_tokens_per_s", "ttft_s", "itl_s")}
    engine.check_no_leaks()
    return {
        "model": engine.model_name,
        "device": describe_device(engine),
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "commit": git_commit(),
        "torch": torch.__version__,
        "engine_config": {k: v for k, v in dataclasses.asdict(engine.config.args).items() if k != "extra"},
        "workload": {"type": workload, "num_requests": w.num_requests, "input_len": list(w.input_len),
                     "output_len": list(w.output_len), "seed": seed, "shared_prefix_len": w.shared_prefix_len},
        "results": results,
    }


def write_json(result: dict[str, Any], path: str) -> None:
    with open(path, "w") as f:
        json.dump(result, f, indent=2)
