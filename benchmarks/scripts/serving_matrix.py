"""Issue 31 on the GPU: the speculative serving matrix. For each combination, one `minidsa serve` on a real-shape
preset, driven over HTTP by `minidsa bench --base-url` (>= 128 requests, concurrency 64); each must start, finish
with 0 failed requests, leave no traceback in its log, answer /health, and hold no KV pages afterwards.

The full product of the dimensions (architecture x MTP chain 3/1/4, chain 1/1/2, tree x DeepGEMM x FlashMLA x MLA
cache dtype) is too many start-ups for one GPU call; COMBOS is a covering set (every value of every dimension at
least once: the guides' combination, MTP 3/1/4 + DeepGEMM + FlashMLA + FP8 cache, on both architectures; a tree
with neither library and a bf16 cache; chain 1/1/2). Overlapped scheduling and prefix caching are on (the defaults) and the KV cache is sized
automatically. Run on one warm machine: the compile caches carry from one server to the next.

    python benchmarks/scripts/serving_matrix.py --out /tmp/out [--only guide_dsv32 ...] [--num-requests 128]

Writes serving_matrix.json / serving_matrix.md under --out (and each server's log) and prints the table; exit code
1 if any combination failed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request

GUIDE = ["--speculative-num-steps", "3", "--kv-cache-dtype", "fp8"]  # DeepGEMM and FlashMLA on by default
COMBOS: dict[str, list[str]] = {  # in run order: a call cut short has run the guides' combination first
    "guide_dsv32": ["--model", "bench-dsv32", *GUIDE],
    "guide_glm5": ["--model", "bench-glm5", *GUIDE],
    "dsv32_tree_nodg_nofmla_bf16": ["--model", "bench-dsv32", "--speculative-num-steps", "3", "--speculative-topk",
                                    "2", "--speculative-num-draft-tokens", "6", "--page-size", "1",
                                    "--disable-deep-gemm", "--disable-flash-mla"],
    "glm5_chain112": ["--model", "bench-glm5", "--speculative-num-steps", "1"],
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str, timeout: float = 5.0) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()
    except OSError as e:
        return 0, str(e)


def _metric(text: str, name: str) -> float | None:
    m = re.search(rf"^{name}(?:{{[^}}]*}})? ([0-9.eE+-]+)$", text, re.M)
    return float(m.group(1)) if m else None


def run_combo(name: str, flags: list[str], args, out_dir: str) -> dict:
    port = _free_port()
    log_path = os.path.join(out_dir, f"server_{name}.log")
    cmd = [sys.executable, "-m", "minidsa", "serve", "--port", str(port), *flags, *args.server_args]
    row: dict = {"name": name, "flags": " ".join(flags), "ok": False}
    start = time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        while True:
            if proc.poll() is not None:
                row["error"] = f"server exited with {proc.returncode} during start-up"
                return row
            status, _ = _get(f"http://127.0.0.1:{port}/health")
            if status == 200:
                break
            if time.perf_counter() - start > args.startup_timeout:
                row["error"] = f"not healthy after {args.startup_timeout} s"
                return row
            time.sleep(1.0)
        row["startup_s"] = time.perf_counter() - start
        result_path = os.path.join(out_dir, f"bench_{name}.json")
        bench = subprocess.run([sys.executable, "-m", "minidsa", "bench", "--base-url", f"http://127.0.0.1:{port}",
                                "--num-requests", str(args.num_requests), "--max-concurrency", str(args.concurrency),
                                "--json", result_path, "--no-progress"], capture_output=True, text=True,
                               timeout=args.bench_timeout)
        row["bench_rc"] = bench.returncode
        if bench.returncode != 0:
            row["error"] = f"minidsa bench exited {bench.returncode}: {bench.stderr.strip()[-400:]}"
            return row
        with open(result_path) as f:
            r = json.load(f)["results"]
        row.update(output_tok_s=r["output_tokens_per_s"], itl_p50_ms=r["itl_s"]["p50"] * 1e3,
                   itl_p99_ms=r["itl_s"]["p99"] * 1e3, ttft_p50_s=r["ttft_s"]["p50"],
                   completed=r.get("completed", r["num_requests"]), failed=r.get("failed", 0))
        health, _ = _get(f"http://127.0.0.1:{port}/health")
        time.sleep(1.0)  # the last requests' KV is freed by the engine thread after their final output
        _, metrics = _get(f"http://127.0.0.1:{port}/metrics")
        row["health_after"] = health
        row["kv_used_tokens_after"] = _metric(metrics, "minidsa_kv_cache_used_tokens")
        draft, accepted = (_metric(metrics, "minidsa_spec_decode_draft_tokens_total"),
                           _metric(metrics, "minidsa_spec_decode_accepted_tokens_total"))
        row["spec_acceptance"] = accepted / draft if draft else None
        problems = []
        if row["failed"]:
            problems.append(f"{row['failed']} failed requests")
        if health != 200:
            problems.append(f"/health {health} after the bench")
        if row["kv_used_tokens_after"] != 0:
            problems.append(f"{row['kv_used_tokens_after']} KV tokens still in use")
        row["error"] = "; ".join(problems) or None
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
        with open(log_path) as f:
            text = f.read()
        if "Traceback" in text:
            row["error"] = ((row.get("error") or "") + "; traceback in the server log").lstrip("; ")
        row["startup_log"] = [ln for ln in text.splitlines() if "start-up" in ln or "KV cache" in ln][-4:]
    row["ok"] = not row.get("error")
    return row


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--only", nargs="*", choices=list(COMBOS), help="a subset of the combinations")
    p.add_argument("--num-requests", type=int, default=128)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--startup-timeout", type=float, default=420)
    p.add_argument("--bench-timeout", type=float, default=300)
    p.add_argument("--server-args", nargs=argparse.REMAINDER, default=[], help="more flags for every server")
    args = p.parse_args()
    # A timeout's SIGTERM must stop the running server too (its `finally`): a server left behind holds the GPU's
    # memory and the next program on the machine finds it full.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    os.makedirs(args.out, exist_ok=True)
    rows: list[dict] = []
    for name in args.only or COMBOS:
        row = run_combo(name, COMBOS[name], args, args.out)
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "startup_log"}), flush=True)
        lines = write_table(rows, args.out)  # after every combination: a call cut short keeps what ran
    print("\n".join(lines))
    return 0 if all(r["ok"] for r in rows) else 1


def write_table(rows: list[dict], out_dir: str) -> list[str]:
    lines = ["| combination | flags | start-up s | output tok/s | ITL p50 ms | ITL p99 ms | failed | result |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        num = lambda k, f: f.format(r[k]) if r.get(k) is not None else "-"  # noqa: E731
        lines.append(f"| {r['name']} | `{r['flags']}` | {num('startup_s', '{:.0f}')} | {num('output_tok_s', '{:.0f}')}"
                     f" | {num('itl_p50_ms', '{:.2f}')} | {num('itl_p99_ms', '{:.2f}')} | {r.get('failed', '-')} | "
                     f"{'ok' if r['ok'] else 'FAILED: ' + str(r.get('error'))} |")
    with open(os.path.join(out_dir, "serving_matrix.json"), "w") as f:
        json.dump({"commit": os.environ.get("MINIDSA_COMMIT"), "date": time.strftime("%Y-%m-%d"), "rows": rows}, f,
                  indent=2)
    with open(os.path.join(out_dir, "serving_matrix.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    return lines


if __name__ == "__main__":
    sys.exit(main())
