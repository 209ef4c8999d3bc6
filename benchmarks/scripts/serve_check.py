"""Issue 48: the deployment guides' recipe through `minidsa serve`, checked end to end (scripts/gpu_check.sh multi_gpu).

Starts `minidsa serve --model M --tp N --port P` plus the given serve flags in the background, waits for /health to
answer 200 (ready_s: process start to ready), reads the KV capacity from /metrics, drives `--requests` requests at
`--concurrency` with `minidsa bench --base-url` (its default workload), then checks: 0 failed, /health ok, no KV in use
(`minidsa_kv_cache_used_tokens` 0: prefix-cached pages are evictable and not counted), nothing running or waiting;
sends SIGTERM to the server and times its exit (at most `--exit-limit` s), then checks that no rank process it
started and no `minidsa serve` / `minidsa.parallel` process is left, and (on a GPU machine) that nvidia-smi lists no
compute process. Writes serve_check.json (and serve.log, bench.json) under --out; exit status 0 when every check
passed.

`--series NAME=FLAGS` (repeatable) runs more `minidsa bench --base-url` workloads against the same server after the
first, in order (issue 50: ITL at a few concurrencies, 2k in / 100 out), each with its own 0-failed check and results
under `series` (written as each ends: a run cut by a timeout keeps the finished ones); `--requests 0` leaves the first
out. On a GPU machine a thread samples nvidia-smi's memory.used per GPU every `--gpu-memory-poll` s from the server's
start to its exit: `gpu_memory_peak_mib` (every process on the GPU, the CUDA contexts included; a spike shorter than
the interval can be missed). The server log's start-up lines (each phase, the total, the kernel choice) are copied
into `startup_log`.

    python3 benchmarks/scripts/serve_check.py --out /tmp/serve --model bench-dsv32:16 --tp 4 -- \\
        --speculative-num-steps 3 --speculative-topk 1 --speculative-num-draft-tokens 4 --kv-cache-dtype fp8
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request


def _get(url: str, timeout: float = 5.0) -> tuple[int | None, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read().decode(errors="replace")
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace")
    except (OSError, ValueError) as e:
        return None, str(e)


def metrics(base: str) -> dict[str, float]:
    """The unlabelled minidsa_* samples of /metrics."""
    status, text = _get(base + "/metrics")
    return parse_metrics(text) if status == 200 else {}


def parse_metrics(text: str) -> dict[str, float]:
    """`name{model_name="..."} value` lines (only the model label) -> {name: value}; histograms and by-label
    counters left out."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line.startswith("minidsa_"):
            continue
        key, _, value = line.rpartition(" ")
        name, _, labels = key.partition("{")
        if labels.count("=") > 1 or name in out:
            continue
        try:
            out[name] = float(value)
        except ValueError:
            pass
    return out


def _children(pid: int) -> list[int]:
    """Processes whose parent is `pid` (the tensor-parallel ranks of a server), from /proc."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry))
        except (OSError, ValueError, IndexError):
            pass
    return found


# Set in the server's environment, so every process it starts carries it: the leftovers counted are this check's
# own, not those of another minidsa running on the machine (a concurrent test).
RUN_MARK = "MINIDSA_SERVE_CHECK_RUN"


def leftover_minidsa(mark: str | None = None) -> list[str]:
    """Command lines of `minidsa serve` / `minidsa.parallel` processes still alive (this one excluded); with `mark`,
    only those whose environment carries RUN_MARK=mark (this check's server and its ranks)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            if mark is not None:
                with open(f"/proc/{entry}/environ", "rb") as f:
                    if f"{RUN_MARK}={mark}".encode() not in f.read().split(b"\0"):
                        continue
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
            with open(f"/proc/{entry}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    continue
        except OSError:
            continue
        if "minidsa.parallel" in cmd or ("minidsa" in cmd and " serve " in f"{cmd} "):
            found.append(f"{entry}: {cmd[:200]}")
    return found


def gpu_compute_processes() -> list[str] | None:
    """nvidia-smi's compute processes (None: no nvidia-smi here)."""
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,process_name,used_memory",
                              "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired) as e:
        return [f"nvidia-smi failed: {e}"]
    return [line.strip() for line in out.splitlines() if line.strip()]


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def parse_gpu_memory(text: str) -> dict[str, tuple[float, float]]:
    """nvidia-smi's `index, memory.used, memory.total` CSV (noheader, nounits) -> {index: (used MiB, total MiB)}."""
    out: dict[str, tuple[float, float]] = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.split(",")]
        if len(cells) == 3:
            try:
                out[cells[0]] = (float(cells[1]), float(cells[2]))
            except ValueError:
                pass
    return out


class GpuMemoryPeak:
    """The highest memory.used nvidia-smi reports per GPU while running (a background thread, every `interval` s);
    `peak_mib` stays None where there is no nvidia-smi."""

    def __init__(self, interval: float):
        self.interval = interval
        self.peak_mib: dict[str, float] | None = None
        self.total_mib: dict[str, float] = {}
        self.samples = 0
        self._stop = threading.Event()
        self._thread = None
        if interval > 0 and shutil.which("nvidia-smi") is not None:
            self.peak_mib = {}
            self._thread = threading.Thread(target=self._run, daemon=True)
            self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                text = subprocess.run(["nvidia-smi", "--query-gpu=index,memory.used,memory.total",
                                       "--format=csv,noheader,nounits"], capture_output=True, text=True,
                                      timeout=10).stdout
            except (OSError, subprocess.TimeoutExpired):
                text = ""
            self.add(parse_gpu_memory(text))
            self._stop.wait(self.interval)

    def add(self, sample: dict[str, tuple[float, float]]) -> None:
        if self.peak_mib is None:
            return
        for index, (used, total) in sample.items():
            self.peak_mib[index] = max(used, self.peak_mib.get(index, 0.0))
            self.total_mib[index] = total
        self.samples += bool(sample)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(15)


def startup_log(path: str, limit: int = 60) -> list[str]:
    """The server log's start-up lines (rank 0's phases, the total, the kernel choice), in order, `limit` at most."""
    found = []
    try:
        with open(path, errors="replace") as f:
            for line in f:
                if "start-up" in line or "Kernel choice" in line:
                    found.append(line.strip()[:400])
                    if len(found) == limit:
                        break
    except OSError:
        pass
    return found


def parse_series(text: str) -> tuple[str, str]:
    """`NAME=FLAGS` -> (NAME, FLAGS); NAME is a word (it names a JSON file and a check)."""
    name, sep, flags = text.partition("=")
    if not sep or not name.replace("_", "").isalnum():
        raise argparse.ArgumentTypeError(f"a series is NAME=FLAGS with NAME a word, got {text!r}")
    return name, flags


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--model", default="bench-dsv32:16")
    p.add_argument("--tp", type=int, default=4)
    p.add_argument("--requests", type=int, default=128)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--health-timeout", type=float, default=400.0, help="seconds for the server to become ready")
    p.add_argument("--bench-timeout", type=float, default=300.0)
    p.add_argument("--exit-limit", type=float, default=10.0, help="seconds from SIGTERM to the server's exit")
    p.add_argument("--bench-args", default="", help="more `minidsa bench` flags, one string")
    p.add_argument("--series", type=parse_series, action="append", default=[], metavar="NAME=FLAGS",
                   help="another `minidsa bench --base-url` run after the first, with these flags (repeatable)")
    p.add_argument("--gpu-memory-poll", type=float, default=1.0,
                   help="seconds between nvidia-smi's memory samples (0: none)")
    p.add_argument("serve_args", nargs=argparse.REMAINDER, help="-- then `minidsa serve` flags")
    args = p.parse_args()
    args.run_mark = f"{os.getpid()}-{time.time_ns()}"
    # A timeout (gpu_check.sh's) sends SIGTERM: leave through `finally`, which stops the server this script started.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    serve_args = [a for a in args.serve_args if a != "--"] if args.serve_args[:1] == ["--"] else args.serve_args
    os.makedirs(args.out, exist_ok=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    base = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "minidsa.cli", "serve", "--model", args.model, "--tp", str(args.tp),
           "--host", "127.0.0.1", "--port", str(port), *serve_args]
    r: dict = {"command": "minidsa serve " + " ".join(cmd[4:]), "model": args.model, "tp": args.tp,
               "requests": args.requests, "concurrency": args.concurrency, "checks": {}, "ok": False}
    log = open(os.path.join(args.out, "serve.log"), "w")
    memory = GpuMemoryPeak(args.gpu_memory_poll)
    t0 = time.perf_counter()
    server = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                              env={**os.environ, RUN_MARK: args.run_mark})
    try:
        return _check(args, server, base, r, t0)
    finally:
        memory.stop()
        r["gpu_memory_peak_mib"], r["gpu_memory_total_mib"] = memory.peak_mib, memory.total_mib or None
        r["gpu_memory_samples"] = memory.samples
        if server.poll() is None:  # a check failed before SIGTERM, or the server did not exit: its group goes
            for sig in (signal.SIGTERM, signal.SIGKILL):
                try:
                    os.killpg(server.pid, sig)
                    server.wait(15)
                    break
                except (OSError, subprocess.TimeoutExpired):
                    pass
        log.close()
        r["startup_log"] = startup_log(os.path.join(args.out, "serve.log"))
        write(args.out, r)
        print(json.dumps({k: v for k, v in r.items() if k not in ("bench", "series", "startup_log")}, indent=2))


def write(out: str, r: dict) -> None:
    path = os.path.join(out, "serve_check.json")
    with open(path + ".tmp", "w") as f:
        json.dump(r, f, indent=2)
    os.replace(path + ".tmp", path)  # a reader never sees half a file


# What a run's JSON keeps of `minidsa bench`'s results (its per-chunk timeline stays in the bench's own file).
BENCH_KEYS = ("num_requests", "completed", "failed", "input_tokens_per_s", "output_tokens_per_s", "total_tokens_per_s",
              "requests_per_s", "duration_s", "ttft_s", "itl_s", "tpot_s", "e2e_s", "first_error")


def run_bench(args, base: str, out_json: str, flags: list[str]) -> dict:
    """`minidsa bench --base-url base` with `flags`: its command, results (BENCH_KEYS; None without a JSON), exit
    status (None: timed out), seconds, output's tail and error (None when it wrote results in time)."""
    bench = [sys.executable, "-m", "minidsa.cli", "bench", "--base-url", base, "--no-progress", "--json", out_json,
             *flags]
    command = "minidsa bench " + " ".join(bench[4:])
    t = time.perf_counter()
    rc, error, tail = None, None, ""
    try:
        proc = subprocess.run(bench, capture_output=True, text=True, timeout=args.bench_timeout)
        rc, tail = proc.returncode, proc.stdout[-3000:] + proc.stderr[-2000:]
    except subprocess.TimeoutExpired:
        error = f"minidsa bench did not finish in {args.bench_timeout:.0f} s"
    seconds = time.perf_counter() - t
    try:
        with open(out_json) as f:
            res = json.load(f)["results"]
        results = {k: res.get(k) for k in BENCH_KEYS}
    except (OSError, KeyError, json.JSONDecodeError):
        results = None
        error = error or f"no results (exit status {rc}): {tail[-500:]}"
    return {"command": command, "results": results, "rc": rc, "seconds": seconds, "stdout_tail": tail, "error": error}


def _check(args, server: subprocess.Popen, base: str, r: dict, t0: float) -> int:
    checks = r["checks"]
    status = None
    while time.perf_counter() - t0 < args.health_timeout and server.poll() is None:
        status, _ = _get(base + "/health", timeout=2.0)
        if status == 200:
            break
        time.sleep(1.0)
    r["ready_s"] = time.perf_counter() - t0
    checks["ready"] = status == 200
    if status != 200:
        r["error"] = f"not ready after {r['ready_s']:.0f} s (last /health {status}; server exit {server.poll()})"
        return 1
    before = metrics(base)
    r["kv_total_tokens"] = before.get("minidsa_kv_cache_total_tokens")
    if args.requests:
        run = run_bench(args, base, os.path.join(args.out, "bench.json"),
                        ["--num-requests", str(args.requests), "--max-concurrency", str(args.concurrency),
                         *args.bench_args.split()])
        r.update(bench_command=run["command"], bench=run["results"], bench_rc=run["rc"], bench_s=run["seconds"],
                 bench_stdout_tail=run["stdout_tail"])
        if run["error"]:
            r["error"] = run["error"]
        b = r["bench"] or {}
        checks["all_completed"] = b.get("completed") == args.requests
        checks["zero_failed"] = b.get("failed") == 0
    r["series"] = {}
    for name, flags in args.series:
        run = run_bench(args, base, os.path.join(args.out, f"bench_{name}.json"), flags.split())
        r["series"][name] = {k: v for k, v in run.items() if k != "stdout_tail"}
        r["series"][name]["stdout_tail"] = run["stdout_tail"][-1500:]
        res = run["results"] or {}
        checks[f"{name}_zero_failed"] = res.get("failed") == 0 and res.get("completed") == res.get("num_requests")
        write(args.out, r)
    deadline = time.perf_counter() + 10.0  # the last requests' pages go back as their streams close
    while True:
        after = metrics(base)
        if after.get("minidsa_kv_cache_used_tokens") == 0 or time.perf_counter() > deadline:
            break
        time.sleep(0.5)
    r["after"] = {k: after.get(f"minidsa_{k}") for k in ("kv_cache_used_tokens", "kv_cache_total_tokens",
                                                         "num_requests_running", "num_requests_waiting",
                                                         "prefix_cache_tokens", "engine_errors_total",
                                                         "requests_finished_total", "preemptions_total",
                                                         "spec_decode_acceptance_ratio")}
    checks["kv_in_use_zero"] = after.get("minidsa_kv_cache_used_tokens") == 0
    checks["nothing_running"] = (after.get("minidsa_num_requests_running") == 0
                                 and after.get("minidsa_num_requests_waiting") == 0)
    status, body = _get(base + "/health")
    r["health_after"] = {"status": status, "body": body[:200]}
    checks["health_ok"] = status == 200
    ranks = _children(server.pid)
    r["rank_pids"] = ranks
    t2 = time.perf_counter()
    server.send_signal(signal.SIGTERM)
    try:
        r["exit_code"] = server.wait(args.exit_limit + 30)
    except subprocess.TimeoutExpired:
        r["exit_code"] = None
    r["exit_s"] = time.perf_counter() - t2
    checks["exit_within_limit"] = r["exit_code"] is not None and r["exit_s"] <= args.exit_limit
    checks["exit_code_zero"] = r["exit_code"] == 0
    deadline = time.perf_counter() + 5.0
    while any(_alive(pid) for pid in ranks) and time.perf_counter() < deadline:
        time.sleep(0.2)
    r["ranks_left"] = [pid for pid in ranks if _alive(pid)]
    r["minidsa_processes_left"] = leftover_minidsa(args.run_mark)
    checks["no_process_left"] = not r["ranks_left"] and not r["minidsa_processes_left"]
    deadline = time.perf_counter() + 10.0
    while True:
        apps = gpu_compute_processes()
        if not apps or time.perf_counter() > deadline:
            break
        time.sleep(1.0)
    r["gpu_compute_processes"] = apps
    if apps is not None:
        checks["no_gpu_process"] = not apps
    r["ok"] = all(checks.values())
    return 0 if r["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
