"""Issue 50: `scripts/gpu_check.sh eight_gpus`'s outputs as one summary JSON, and that JSON as the Markdown tables for
benchmarks/multi_gpu/NOTES.md: one (model, parallel mode) served whole by `minidsa serve` with the guides' recipe.
Tables: decode ITL at each concurrency (MTP at simulated acceptance against plain), `minidsa bench` at 2k in / 100
out and at the default workload, start-up cold and warm with KV capacity and peak memory per GPU, the servers'
checks; beside them the published 8xH200 figures (from the shared REFERENCE_NOTES.md) with every difference in
workload spelled out. Device, date, commit and commands go with every table.

The section runs each part into $OUT/eight_gpus_raw/ (mtp/, warm/, plain/: serve_check.py's serve_check.json, the
server log and each bench's JSON; parts.txt, meta.txt, gpus.txt) and calls, after each part,

    python3 benchmarks/scripts/eight_gpu_page.py --collect $OUT/eight_gpus_raw --json $OUT/eight_gpus.json \\
        --markdown $OUT/eight_gpus.md

The page alone, from a summary JSON brought back:

    python3 benchmarks/scripts/eight_gpu_page.py --json eight_gpus.json --markdown /tmp/eight_gpus.md
"""

from __future__ import annotations

import json
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ab import _load  # noqa: E402
from multi_gpu_page import _f, _parts, parts_table, read_meta, run_page  # noqa: E402

SERVERS = ("mtp", "warm", "plain")  # the section's parts, each one server
REFERENCE = "REFERENCE_NOTES.md (../shared), \"Serving anchors\" and \"Published serving figures\""

# The published 8xH200 figures the issue compares against, as REFERENCE_NOTES.md words them.
PUBLISHED = {
    "dsv32": {
        "setup": "SGLang v0.5.6, DeepSeek-V3.2, 8xH200, TP8 + DP attention (gpustack performance lab)",
        "mode": "dp",
        "2k": {"total_tok_s": 27700.0, "text": "27.7k total tok/s at 2k in / 100 out"},
        "concurrency": {},
    },
    "glm5": {
        "setup": "SGLang, GLM-5-FP8, 8xH200, TP8, MTP 3/1/4 (EAGLE), real acceptance",
        "mode": "tp",
        "2k": None,
        "concurrency": {1: {"tok_s": 118.0, "tpot_ms": 7.5, "text": "118 tok/s, TPOT 7.5 ms, accept length 3.48"},
                        100: {"tok_s": 1215.0, "tpot_ms": 38.7, "text": "1215 tok/s, TPOT 38.7 ms"}},
    },
}


def family(model: str | None) -> str | None:
    """bench-dsv32:61 -> dsv32, bench-glm5:78 -> glm5; None for another preset (tiny)."""
    m = re.match(r"bench-(dsv32|glm5)\b", model or "")
    return m.group(1) if m else None


def _slim(r: dict | None) -> dict | None:
    """A server's serve_check.json without the outputs' tails (they stay in the raw tarball)."""
    if r is None:
        return None
    r = json.loads(json.dumps(r))
    r.pop("bench_stdout_tail", None)
    for s in (r.get("series") or {}).values():
        s.pop("stdout_tail", None)
    return r


def collect(raw: str) -> dict:
    meta = read_meta(raw)
    try:
        with open(os.path.join(raw, "meta.txt")) as f:
            m = re.search(r"\bmode=(\S+)", f.read())
        meta["mode"] = m.group(1) if m else None
    except OSError:
        meta["mode"] = None
    meta["device"] = device(meta.get("gpus"), meta.get("engine_args"))
    servers = {name: _slim(_load(os.path.join(raw, name, "serve_check.json"))) for name in SERVERS}
    return {"meta": meta, "parts": _parts(os.path.join(raw, "parts.txt")),
            "servers": {k: v for k, v in servers.items() if v is not None}}


def device(gpus: str | None, engine_args: str | None) -> str:
    """nvidia-smi's list -> "8 x NVIDIA H200"; a CPU dry run says so."""
    if "--device cpu" in (engine_args or ""):
        return "cpu (a dry run: the figures mean nothing)"
    names = [line.split(",")[1].strip() for line in (gpus or "").splitlines()[1:] if line.count(",") >= 3]
    return f"{len(names)} x {names[0]}" if names else "?"


def _pct(d: dict | None, key: str, p: str, scale: float = 1.0) -> float | None:
    v = ((d or {}).get(key) or {}).get(p)
    return None if v is None else scale * v


def _series(server: dict | None, name: str) -> dict | None:
    return ((server or {}).get("series") or {}).get(name)


def _results(server: dict | None, name: str) -> dict | None:
    return (_series(server, name) or {}).get("results")


def _x(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}x" if a is not None and b else "-"


def concurrencies(servers: dict) -> list[int]:
    found = set()
    for server in servers.values():
        for name in (server.get("series") or {}):
            m = re.fullmatch(r"itl_c(\d+)", name)
            if m:
                found.add(int(m.group(1)))
    return sorted(found)


def _source(meta: dict, server: dict | None) -> str:
    return (f"{meta.get('device') or '?'}, {meta.get('date') or '?'}, commit {meta.get('commit') or '?'}: "
            f"`{(server or {}).get('command', '?')}`")


def _commands(servers: dict, names: list[str]) -> list[str]:
    """Each part's server command and the `minidsa bench` command of each of `names` it ran."""
    L = []
    for part in ("mtp", "plain"):
        server = servers.get(part)
        if not server:
            continue
        L.append(f"- {part}: `{server.get('command', '?')}`")
        L += [f"  - {n}: `{_series(server, n)['command']}`" for n in names if _series(server, n)]
    return L


def itl_table(s: dict) -> list[str]:
    meta, servers = s.get("meta") or {}, s.get("servers") or {}
    cs = concurrencies(servers)
    if not cs:
        return []
    pub = PUBLISHED.get(family(meta.get("model")) or "", {})
    pub_c = pub.get("concurrency") or {}
    mtp, plain = servers.get("mtp"), servers.get("plain")
    L = ["## Decode ITL by concurrency, through `minidsa serve`", "",
         f"{meta.get('device') or '?'}, {meta.get('date') or '?'}, commit {meta.get('commit') or '?'}; commands below.",
         "", "| concurrency | requests (failed) | MTP ITL p50 / p99 ms | MTP TPOT p50 ms | MTP output tok/s | "
         "plain ITL p50 / p99 ms | plain TPOT p50 ms | plain output tok/s | MTP / plain output tok/s | "
         "published (SGLang, 8xH200) |", "|---:|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for c in sorted(set(cs) | set(pub_c)):
        a, b = _results(mtp, f"itl_c{c}"), _results(plain, f"itl_c{c}")
        published = pub_c[c]["text"] if c in pub_c else "-"
        if a is None and b is None:
            L.append(f"| {c} | not measured | | | | | | | | {published} |")
            continue
        reqs = " / ".join(f"{r['completed']} ({r['failed']})" if r else "-" for r in (a, b))
        cells = []
        for r in (a, b):
            cells += [f"{_f(_pct(r, 'itl_s', 'p50', 1e3), 2)} / {_f(_pct(r, 'itl_s', 'p99', 1e3), 2)}",
                      _f(_pct(r, "tpot_s", "p50", 1e3), 2), _f((r or {}).get("output_tokens_per_s"), 1)]
        ratio = _x((a or {}).get("output_tokens_per_s"), (b or {}).get("output_tokens_per_s"))
        L.append(f"| {c} | {reqs} | " + " | ".join(cells) + f" | {ratio} | {published} |")
    m = re.search(r"--speculative-simulate-accept-len (\S+)", (mtp or {}).get("command", ""))
    L += ["", "Requests: MTP / plain, completed (failed). ITL: between streamed chunks on the client; with MTP a chunk "
          f"carries the tokens a round accepted ({m.group(1) if m else '?'} on average here), so TPOT ((end-to-end "
          "- TTFT) / (tokens - 1), per request) is the figure to set beside the published TPOT. Output tok/s: all "
          "requests' output tokens over the run. MTP: 3/1/4 at simulated acceptance (the server commands below)."
          + (f" Published: {pub['setup']}." if pub else ""), ""]
    return L + _commands(servers, [f"itl_c{c}" for c in cs]) + [""]


def throughput_table(s: dict) -> list[str]:
    meta, servers = s.get("meta") or {}, s.get("servers") or {}
    mtp, plain = servers.get("mtp"), servers.get("plain")
    names = [n for n in ("2k", "default") if _results(mtp, n) or _results(plain, n)]
    if not names:
        return []
    pub = PUBLISHED.get(family(meta.get("model")) or "", {})
    L = ["## `minidsa bench` through `minidsa serve`: 2k in / 100 out and the default workload", "",
         f"{meta.get('device') or '?'}, {meta.get('date') or '?'}, commit {meta.get('commit') or '?'}; commands below.",
         "", "| workload | server | requests completed / failed | input tok/s | output tok/s | total tok/s | "
         "duration s | TTFT p50 / p99 s | published (SGLang, 8xH200) | ours / published |",
         "|---|---|---|---:|---:|---:|---:|---:|---|---:|"]
    for n in names:
        published = (pub.get("2k") or {}) if n == "2k" else {}
        for part, label in (("mtp", "MTP 3/1/4"), ("plain", "plain")):
            r = _results(servers.get(part), n)
            if r is None:
                continue
            total = r.get("total_tokens_per_s")
            L.append(f"| {'2k in / 100 out' if n == '2k' else 'default'} | {label} | {r.get('completed')} / "
                     f"{r.get('failed')} | {_f(r.get('input_tokens_per_s'), 1)} | "
                     f"{_f(r.get('output_tokens_per_s'), 1)} | {_f(total, 1)} | {_f(r.get('duration_s'), 1)} | "
                     f"{_f(_pct(r, 'ttft_s', 'p50'), 3)} / {_f(_pct(r, 'ttft_s', 'p99'), 3)} | "
                     f"{published.get('text', '-')} | {_x(total, published.get('total_tok_s'))} |")
    own = all(re.search(r"--json \S+$", (_series(servers.get(p), "default") or {}).get("command", "--json x"))
              for p in ("mtp", "plain"))
    L += ["", "Total tok/s: (input + output tokens) / the run's duration, on the client. Default workload: "
          + ("`minidsa bench`'s own (256 requests, input and output lengths uniform in 100-1024, seed 0), sent at once."
             if own else "the flags of its command below.") + (f" Published: {pub['setup']}." if pub else ""), ""]
    return L + _commands(servers, names) + [""]


def _memory(server: dict) -> str:
    peak = server.get("gpu_memory_peak_mib")
    if not peak:
        return "-"
    total = server.get("gpu_memory_total_mib") or {}
    hi = max(peak, key=peak.get)
    per = ", ".join(f"{i}: {peak[i] / 1024:.1f}" for i in sorted(peak, key=int))
    return (f"max {peak[hi] / 1024:.1f} GiB (GPU {hi}) of {total.get(hi, 0) / 1024:.1f}; per GPU {per}")


def _startup(server: dict) -> tuple[str, str]:
    """The engine's own start-up total and its compile-cache phase, from the server log's lines."""
    total = cache = "-"
    for line in server.get("startup_log") or []:
        m = re.search(r"start-up ([\d.]+) s:", line)
        if m:
            total = m.group(1)
        m = re.search(r"start-up: compile cache [\d.]+ s \((.*)\)", line)
        if m:
            cache = m.group(1)
    return total, cache


def startup_table(s: dict) -> list[str]:
    meta, servers = s.get("meta") or {}, s.get("servers") or {}
    if not servers:
        return []
    what = {"mtp": "MTP 3/1/4, first start (cold: an empty compile cache)",
            "warm": "MTP 3/1/4 again (warm: the caches the first start filled)",
            "plain": "plain (after the MTP starts, same compile cache)"}
    L = ["## Start-up, KV capacity, peak memory per GPU", "",
         "| server | process start to /health 200, s | engine start-up, s | compile cache at start | "
         "KV capacity, tokens | peak memory.used per GPU (GiB) |", "|---|---:|---:|---|---:|---|"]
    for part in SERVERS:
        server = servers.get(part)
        if not server:
            continue
        total, cache = _startup(server)
        kv = server.get("kv_total_tokens")
        L.append(f"| {what[part]} | {_f(server.get('ready_s'), 1)} | {total} | {cache} | "
                 f"{'-' if kv is None else int(kv)} | {_memory(server)} |")
    L += ["", "Start-up: the server process's start to /health answering 200 (serve_check.py), and the engine's own "
          "line (weights drawn on the GPUs, activation profile, KV cache, capture, warm-up; the ranks start inside "
          "it). KV capacity: the automatic one, from /metrics (under DP attention the ranks' caches together). Peak "
          "memory: nvidia-smi's memory.used sampled every second from the server's start to its exit (every process "
          "on the GPU, CUDA contexts included; a spike shorter than a second can be missed).", ""]
    L += [f"- {part}: {_source(meta, servers[part])}" for part in SERVERS if part in servers]
    return L + [""]


def checks_table(s: dict) -> list[str]:
    servers = s.get("servers") or {}
    if not servers:
        return []
    parts = [p for p in SERVERS if p in servers]
    names: list[str] = []
    for p in parts:
        names += [n for n in servers[p].get("checks") or {} if n not in names]
    L = ["## The servers' checks", "", "| check | " + " | ".join(parts) + " |", "|---|" + "---|" * len(parts)]
    for n in names:
        cells = []
        for p in parts:
            ok = (servers[p].get("checks") or {}).get(n)
            cells.append("" if ok is None else "yes" if ok else "**NO**")
        L.append(f"| {n.replace('_', ' ')} | " + " | ".join(cells) + " |")
    L.append("| **all** | " + " | ".join("passed" if servers[p].get("ok") else "**FAILED**" for p in parts) + " |")
    L.append("| SIGTERM to exit s (limit 10) | " + " | ".join(_f(servers[p].get("exit_s"), 2) for p in parts) + " |")
    errors = [f"- {p}: {servers[p]['error']}" for p in parts if servers[p].get("error")]
    return L + ([""] + errors if errors else []) + [""]


def differences(meta: dict, servers: dict) -> list[str]:
    """What differs between these runs and the published ones, spelled out for this model and mode."""
    fam = family(meta.get("model"))
    pub = PUBLISHED.get(fam or "")
    if pub is None:
        return ["## Published figures", "", f"None for {meta.get('model') or '?'}: the published 8xH200 figures are "
                "for DeepSeek-V3.2 and GLM-5 (bench-dsv32:61, bench-glm5:78).", ""]
    full = {"dsv32": 61, "glm5": 78}[fam]
    layers = re.search(r":(\d+)$", meta.get("model") or "")
    mode = meta.get("mode")
    ours = f"--tp {meta.get('tp')}" + (" --enable-dp-attention" if mode == "dp" else "")
    L = ["## Against the published figures: what differs", "",
         f"Published: {pub['setup']}; source: {REFERENCE}. Differences from the runs above:", "",
         f"- Weights: the preset {meta.get('model')} (the real model's per-layer shapes and FP8 block-scaled weights, "
         "random, drawn on the GPUs) against the real checkpoint; the compute per token is the same shape, the "
         "tokens are not the model's."]
    if layers and int(layers.group(1)) != full or str(meta.get("tp")) != "8":
        L.append(f"- Not comparable as it stands: {layers.group(1) if layers else '?'} layers of {full} on "
                 f"{meta.get('tp')} GPUs (a rehearsal), against the whole model on 8.")
    L += ["- Speculative acceptance: simulated (`--speculative-simulate-accept-len`, the same mean on every rank) "
          "against the model's own. " + ("Published GLM-5 accept length: 3.48." if fam == "glm5" else
                                         "REFERENCE_NOTES.md does not say whether the V3.2 run used MTP: the plain "
                                         "rows are the other reading."),
          "- Prompts: random token ids of fixed lengths (`minidsa bench`, `ignore_eos`, greedy, streamed "
          "`/v1/completions`) against the published run's dataset, whose prompt distribution REFERENCE_NOTES.md does "
          "not give.",
          f"- Parallel mode: `{ours}` here; published: " + ("TP8 with DP attention (`--tp 8 --dp 8 "
                                                            "--enable-dp-attention`)." if pub["mode"] == "dp" else
                                                            "TP8 without DP attention."),
          "- KV cache: fp8 (656 bytes per token) here; SGLang's default on H200 is bf16, and REFERENCE_NOTES.md does "
          "not say the published runs changed it.",
          "- Concurrency: " + ("the published figures are at 1 and 100; here at "
                               f"{', '.join(map(str, concurrencies(servers))) or '-'}."
                               if fam == "glm5" else "the 2k / 100 run's concurrency is not published; here every "
                               "request is sent at once, the engine admitting what its budgets allow."),
          "- Engine: minidsa (commit above) against SGLang" + (" v0.5.6." if fam == "dsv32" else
                                                              " (version not given)."),
          "- Total tok/s: (input + output tokens) / the run's duration on the client; the published total is taken "
          "to be the same measure.", ""]
    return L


def page(s: dict) -> str:
    meta = s.get("meta") or {}
    mode = "DP attention" if meta.get("mode") == "dp" else "tensor parallelism"
    regen = (f"OUT=$OUT MINIDSA_COMMIT=<commit> DEEPGEMM=on FLASHMLA=on X8_MODEL={meta.get('model') or '?'} "
             f"X8_MODE={meta.get('mode') or '?'} X8_TP={meta.get('tp') or '?'} bash scripts/gpu_check.sh eight_gpus")
    L = ["# The whole model on 8 GPUs through `minidsa serve`: current figures", "",
         f"{meta.get('model') or '?'}, {mode} over {meta.get('tp') or '?'} GPUs, on {meta.get('device') or '?'}; "
         f"{meta.get('date') or '?'}, commit {meta.get('commit') or '?'}; engine flags of every server: "
         f"`{meta.get('engine_args') or ''}`. Every row regenerates with `{regen}` (`benchmarks/scripts/"
         "eight_gpu_page.py` writes this page).", ""]
    L += itl_table(s) + throughput_table(s) + startup_table(s) + checks_table(s)
    L += differences(meta, s.get("servers") or {}) + parts_table(s)
    return "\n".join(L).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    return run_page(__doc__, collect, page, argv, indent=1)

if __name__ == "__main__":
    sys.exit(main())
