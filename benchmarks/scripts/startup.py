"""Engine start-up, phase by phase, with empty caches ("cold": a fresh machine's compile caches) and again on
the same caches ("warm": the second start on that machine). Each start is a fresh process.

    PYTHONPATH=. python3 benchmarks/scripts/startup.py --models bench-dsv32 --runs cold warm --out $OUT
    PYTHONPATH=. python3 benchmarks/scripts/startup.py --models tiny:4 tiny:61 --runs cold --out $OUT

Per model, one new compile cache directory (MINIDSA_CACHE_DIR; TORCHINDUCTOR_CACHE_DIR, TRITON_CACHE_DIR and
DG_JIT_CACHE_DIR are unset for the children, so inductor's, Triton's and DeepGEMM's caches all live in it),
kept for the model's runs in order: "cold" finds it empty, "warm" finds what cold left. A fresh machine also
has cold OS file caches and no CUDA driver cache; this measures the compile caches only. Each child reports
the seconds to `LLM(...)` returned (engine ready) and to the first token of a one-token request, and the
engine's start-up lines (`minidsa.exec.startup`): the seconds of each phase and what it compiled or found cached.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

CHILD = r"""
import logging, os, sys, time
t = time.perf_counter()
if os.environ.get("STARTUP_COMPILE_LOG"):
    # Every Triton compilation this process runs (minidsa's kernels; inductor's compile in its own workers and
    # show here only as cache loads): kernel name, seconds, phase-independent. Printed as one JSON line at exit.
    import atexit, collections, json, threading
    import triton, triton.compiler, triton.compiler.compiler as tcc
    compiles = collections.defaultdict(lambda: [0, 0.0])
    original = tcc.compile
    def timed_compile(src, *a, **k):
        start = time.perf_counter()
        try:
            return original(src, *a, **k)
        finally:
            entry = compiles[getattr(src, "name", type(src).__name__) + ("" if threading.current_thread() is threading.main_thread() else " (thread)")]
            entry[0] += 1
            entry[1] += time.perf_counter() - start
    tcc.compile = triton.compiler.compile = triton.compile = timed_compile
    # Where the main thread spends start-up, sampled every 0.2 s: seconds per function anywhere on its stack
    # (inclusive), for torch's, Triton's, DeepGEMM's and minidsa's functions.
    stacks = collections.Counter()
    main_id = threading.main_thread().ident
    def sample():
        last = time.perf_counter()
        while True:
            time.sleep(0.2)
            now = time.perf_counter()
            frame, seen = sys._current_frames().get(main_id), set()
            while frame is not None:
                path = frame.f_code.co_filename
                for root in ("torch/", "triton/", "deep_gemm/", "minidsa/", "flash_mla/"):
                    if root in path:
                        seen.add(path[path.rindex(root):] + ":" + frame.f_code.co_name)
                        break
                frame = frame.f_back
            for name in seen:
                stacks[name] += now - last
            last = now
    threading.Thread(target=sample, daemon=True).start()
    atexit.register(lambda: print("MAIN_THREAD_PROFILE", json.dumps([(n, round(s, 1)) for n, s in stacks.most_common(80)]), flush=True))
    atexit.register(lambda: print("TRITON_COMPILES", json.dumps(sorted(((n, c, round(s, 2)) for n, (c, s) in compiles.items()), key=lambda r: -r[2])), flush=True))
logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s", stream=sys.stdout)
logging.getLogger("minidsa.exec.startup").setLevel(logging.INFO)
if os.environ.get("STARTUP_NO_AUTOTUNE"):  # experiment: inductor takes each kernel's first config unmeasured
    from torch._inductor.runtime.triton_heuristics import CachingAutotuner
    CachingAutotuner.benchmark_all_configs = lambda self, *a, **k: {l: float(i) for i, l in enumerate(self.launchers)}
for setting in filter(None, os.environ.get("STARTUP_INDUCTOR_CONFIG", "").split(",")):
    import ast, torch._inductor.config as inductor_config
    key, value = setting.split("=")
    inductor_config.patch({key.strip(): ast.literal_eval(value.strip())}).__enter__()
from minidsa import LLM, SamplingParams
llm = LLM(model=sys.argv[1], progress=False, max_running_requests=int(sys.argv[2]), cuda_graph_max_bs=int(sys.argv[2]))
ready = time.perf_counter() - t
llm.generate([list(range(100, 164))], SamplingParams(max_tokens=1, ignore_eos=True, detokenize=False))
print("STARTUP_SECONDS", ready, time.perf_counter() - t, flush=True)
"""

PHASE = re.compile(r"^minidsa\.exec\.startup: start-up: (?P<name>[^()]+?) (?P<s>[\d.]+) s(?: \((?P<detail>.*)\))?$")
TOTAL = re.compile(r"^minidsa\.exec\.startup: (start-up [\d.]+ s: .*)$")


def run_once(model: str, max_bs: int, cache: str, timeout: float, compile_log: bool = False,
             inductor_config: str = "") -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR", "DG_JIT_CACHE_DIR")}
    if compile_log:
        env["STARTUP_COMPILE_LOG"] = "1"
        env["TORCH_LOGS"] = "recompiles"
    env["MINIDSA_CACHE_DIR"] = cache
    if inductor_config == "no-autotune":
        env["STARTUP_NO_AUTOTUNE"] = "1"
    elif inductor_config:
        env["STARTUP_INDUCTOR_CONFIG"] = inductor_config
    t = time.perf_counter()
    try:
        r = subprocess.run([sys.executable, "-c", CHILD, model, str(max_bs)], env=env, capture_output=True,
                           text=True, timeout=timeout)
        out, err, rc = r.stdout, r.stderr, r.returncode
    except subprocess.TimeoutExpired as e:
        out, err, rc = e.stdout or "", e.stderr or "", "timeout"
        out, err = (x.decode() if isinstance(x, bytes) else x for x in (out, err))
    row: dict = {"process_s": round(time.perf_counter() - t, 1), "rc": rc, "phases": [], "summary": ""}
    for line in out.splitlines():
        if line.startswith("STARTUP_SECONDS"):
            _, ready, first = line.split()
            row["ready_s"], row["first_token_s"] = round(float(ready), 1), round(float(first), 1)
        elif line.startswith("TRITON_COMPILES"):
            row["triton_compiles"] = json.loads(line.split(None, 1)[1])
        elif line.startswith("MAIN_THREAD_PROFILE"):
            row["main_thread_profile"] = json.loads(line.split(None, 1)[1])
        elif m := PHASE.match(line):
            row["phases"].append({"phase": m["name"], "s": float(m["s"]), "detail": m["detail"] or ""})
        elif m := TOTAL.match(line):
            row["summary"] = m.group(1)
    if compile_log:  # TORCH_LOGS=recompiles: why Dynamo compiled each graph after the first
        # per recompilation ([frame/N]), the guards of earlier entries that failed, the layer-type checks left out
        row["recompiles"] = list(dict.fromkeys(
            f"[{m[1]}/{m[2]}] {m[4][:300]}" for line in err.splitlines()
            if (m := re.search(r"\[(\d+)/(\d+)\] \[__recompiles\]\s+- \d+/(\d+): (.*)", line))
            and "___check_type_id" not in m[4]))
    if rc:
        row["error"] = (err or out)[-1500:]
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["tiny:4", "tiny:61"])
    ap.add_argument("--runs", nargs="+", default=["cold"], choices=("cold", "warm"),
                    help="cold: a new, empty cache directory; warm: the same directory again (after cold)")
    ap.add_argument("--max-bs", type=int, default=64, help="largest CUDA-graph batch bucket")
    ap.add_argument("--timeout", type=float, default=540, help="seconds per start before it is stopped")
    ap.add_argument("--compile-log", action="store_true",
                    help="time every Triton compilation in the engine's process, per kernel (the row's triton_compiles), "
                    "sample where its main thread spends the time, and log Dynamo's recompilations")
    ap.add_argument("--inductor-config", default="",
                    help="inductor settings for the children, e.g. 'triton.autotune_pointwise=False' (comma-separated); "
                    "'no-autotune': every inductor kernel runs its first config, none measured (an experiment)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    rows = []
    for model in args.models:
        cache = tempfile.mkdtemp(prefix="minidsa-startup-")
        try:
            for run in args.runs:
                if run == "cold":
                    shutil.rmtree(cache)
                    os.makedirs(cache)
                row = {"model": model, "run": run, "inductor_config": args.inductor_config, **run_once(model, args.max_bs, cache, args.timeout, args.compile_log, args.inductor_config)}
                rows.append(row)
                print(json.dumps(row), flush=True)
        finally:
            shutil.rmtree(cache, ignore_errors=True)
    names = list(dict.fromkeys(p["phase"] for row in rows for p in row["phases"]))
    print("\n| model | run | to first token s | LLM() s | " + " | ".join(names) + " |")
    print("|---|---|---|---|" + "---|" * len(names))
    for row in rows:
        cells = [f"{sum(p['s'] for p in row['phases'] if p['phase'] == n):.1f}" if any(
            p["phase"] == n for p in row["phases"]) else "-" for n in names]
        print(f"| {row['model']} | {row['run']} | {row.get('first_token_s', row['rc'])} | {row.get('ready_s', '-')} | "
              + " | ".join(cells) + " |")
    for row in rows:
        if row.get("triton_compiles"):
            total = sum(r[2] for r in row["triton_compiles"])
            print(f"\n{row['model']} {row['run']}: Triton compilations in the engine's process, {total:.1f} s; top 25:")
            for name, count, seconds in row["triton_compiles"][:25]:
                print(f"  {seconds:7.2f} s  {count:4d}  {name}")
        if row.get("main_thread_profile"):
            print(f"\n{row['model']} {row['run']}: main thread, inclusive seconds by function (sampled):")
            for name, seconds in row["main_thread_profile"]:
                print(f"  {seconds:7.1f} s  {name}")
        for line in row.get("recompiles", []):
            print("  " + line[-300:])
    print("\nphase details (what compiled, what the caches gave):")
    for row in rows:
        for p in row["phases"]:
            if p["detail"]:
                print(f"  {row['model']} {row['run']} {p['phase']}: {p['detail']}")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "startup.json"), "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
