"""Issue 48: the multi_gpu section's outputs as one summary JSON, and that JSON as the Markdown of
benchmarks/multi_gpu/NOTES.md (current figures first; device, date, commit and command with every table).

`scripts/gpu_check.sh multi_gpu` runs each part into $OUT/multi_gpu_raw/<part>/ and calls, after each part,

    python3 benchmarks/scripts/multi_gpu_page.py --collect $OUT/multi_gpu_raw --json $OUT/multi_gpu.json \\
        --markdown $OUT/multi_gpu.md

which gathers profile_tp.json (profile, shallow, one_gpu_*), speculative.json (spec) and serve_check.json (serve) with
the parts' exit status and seconds into multi_gpu.json, then writes the page. The page alone, from a summary JSON
brought back (raw profile JSON beside it adds nothing the summary lacks but the full kernel lists):

    python3 benchmarks/scripts/multi_gpu_page.py --json multi_gpu.json --markdown benchmarks/multi_gpu/NOTES.md
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ab import _load  # noqa: E402  (a JSON file, or None when missing or broken)


def _slim_profile(r: dict | None) -> dict | None:
    """profile_tp.json without the full kernel lists (they stay in the raw tarball)."""
    if r is None:
        return None
    r = json.loads(json.dumps(r))
    for b in r.get("batches", []):
        b.get("profile", {}).pop("all", None)
    for per in (r.get("ranks") or {}).values():
        for p in per.values():
            p.pop("all", None)
    return r


def _parts(path: str) -> dict[str, dict]:
    out: dict[str, dict] = {}
    try:
        with open(path) as f:
            lines = f.read().splitlines()
    except OSError:
        return out
    for line in lines:
        name, *rest = line.split()
        entry: dict = {}
        for kv in rest:
            if kv == "skipped":
                entry["skipped"] = True
            elif "=" in kv:
                k, v = kv.split("=", 1)
                entry[k] = int(v) if v.lstrip("-").isdigit() else v
        out[name] = entry
    return out


def read_meta(raw: str) -> dict:
    """A section's meta.txt (`model=M tp=N engine=FLAGS date=D commit=C`) and gpus.txt (nvidia-smi's list)."""
    meta: dict = {}
    try:
        with open(os.path.join(raw, "meta.txt")) as f:
            text = f.read().strip()
        for key in ("model", "tp", "date", "commit"):
            m = re.search(rf"\b{key}=(\S+)", text)
            if m:
                meta[key] = m.group(1)
        m = re.search(r"\bengine=(.*?) date=", text)
        meta["engine_args"] = m.group(1) if m else None
    except OSError:
        pass
    try:
        with open(os.path.join(raw, "gpus.txt")) as f:
            meta["gpus"] = f.read().strip()
    except OSError:
        pass
    return meta


def collect(raw: str) -> dict:
    meta = read_meta(raw)
    out: dict = {"meta": meta, "parts": _parts(os.path.join(raw, "parts.txt")),
                 "profile": _slim_profile(_load(os.path.join(raw, "profile", "profile_tp.json"))),
                 "shallow": _slim_profile(_load(os.path.join(raw, "shallow", "profile_tp.json"))),
                 "one_gpu": {}, "speculative": _load(os.path.join(raw, "spec", "speculative.json")),
                 "serve": _load(os.path.join(raw, "serve", "serve_check.json"))}
    for path in sorted(glob.glob(os.path.join(raw, "one_gpu_*", "profile_tp.json"))):
        r = _slim_profile(_load(path))
        if r is not None:
            out["one_gpu"][r.get("model") or os.path.basename(os.path.dirname(path))] = r
    for src in (out["profile"], out["speculative"]):
        if src and not meta.get("device"):
            meta["device"] = src.get("device")
    return out


def _f(v, digits: int = 3) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def _source(meta: dict, r: dict | None, command: str | None) -> str:
    r = r or {}
    device = r.get("device") or meta.get("device") or "?"
    date = r.get("date") or meta.get("date") or "?"
    commit = r.get("commit") or meta.get("commit") or "?"
    return f"{device}, {date}, commit {commit}: `{command or r.get('command') or '?'}`"


def _layers(model: str | None) -> int | None:
    m = re.fullmatch(r".+:(\d+)", model or "")
    return int(m.group(1)) if m else None


def _batch(r: dict | None, bs: int) -> dict | None:
    return next((b for b in (r or {}).get("batches", []) if b["batch"] == bs), None)


def per_layer(deep: dict | None, shallow: dict | None, bs: int = 1) -> dict | None:
    """(deep - shallow) / layers between, at batch bs: step, kernel time, collectives."""
    ld, ls = _preset_layers(deep), _preset_layers(shallow)
    a, b = _batch(deep, bs), _batch(shallow, bs)
    if not (a and b and ld and ls and ld > ls):
        return None
    n = ld - ls
    coll = lambda x: x["profile"]["categories"]["collectives"]["us_per_step"]  # noqa: E731
    return {"layers": (ls, ld), "step_ms": (a["step_ms"] - b["step_ms"]) / n,
            "kernel_ms": (a["profile"]["kernel_ms"] - b["profile"]["kernel_ms"]) / n,
            "collectives_us": (coll(a) - coll(b)) / n,
            "kernels": (a["profile"]["kernels_per_step"] - b["profile"]["kernels_per_step"]) / n}


def _preset_layers(r: dict | None) -> int | None:
    """The layer count of a profile_tp run's preset (NAME:LAYERS; a bench preset alone has 4)."""
    r = r or {}
    preset = r.get("preset")
    if preset is None:
        m = re.search(r"--model[ =](\S+)", r.get("command", ""))
        preset = m.group(1) if m else ""
    return _layers(preset) or (4 if preset.startswith("bench-") else None)


def page(s: dict) -> str:
    meta = s.get("meta", {})
    prof, serve, spec = s.get("profile"), s.get("serve"), s.get("speculative")
    model, tp = meta.get("model") or (prof or {}).get("model"), meta.get("tp") or (prof or {}).get("tp")
    L = ["# Tensor parallelism at depth: current figures", "",
         f"{model} at TP={tp} on {meta.get('device') or '?'}; {meta.get('date') or '?'}, commit "
         f"{meta.get('commit') or '?'}; engine flags of every part: `{meta.get('engine_args') or ''}`. "
         "Made by `scripts/gpu_check.sh multi_gpu` and `benchmarks/scripts/multi_gpu_page.py`.", ""]
    if prof:
        L += ["## Decode step and ITL (steady decode through the engine)", "", _source(meta, prof, None), "",
              "| batch | step ms | ITL ms | output tok/s | forward GPU ms per step | host ms | kernels ms (profiled) | "
              "busy ms | gap ms | kernels per step |", "|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|"]
        for b in prof["batches"]:
            p = b["profile"]
            fwd = ", ".join(f"{k} {v:.3f}" for k, v in b["forward_gpu_ms_per_step"].items())
            L.append(f"| {b['batch']} | {b['step_ms']:.3f} | {_f(b.get('itl_ms'))} | {b['tok_per_s']:.0f} | {fwd} | "
                     f"{b['host_ms_per_step']:.3f} | {p['kernel_ms']:.3f} | {p['busy_ms']:.3f} | {p['gap_ms']:.3f} | "
                     f"{p['kernels_per_step']:.0f} |")
        L += ["", "Step and ITL: unprofiled steps; kernels / busy / gap: the profiled steps on rank 0 (busy = the "
              "union of the kernels' intervals, gap = profiled step minus busy: the GPU idle, waiting for the host).",
              ""]
    L += startup_table(s)
    if prof:
        L += category_tables(prof, meta)
    pl = per_layer(prof, s.get("shallow"))
    one = s.get("one_gpu") or {}
    if pl or one:
        L += ["## Batch-1 time per layer", "",
              "(deep - shallow) / the layers between them, from the unprofiled batch-1 step and the profiled kernels; "
              "the lm_head, the embedding and the dense layers are out of it.", "",
              "| run | presets | step ms per layer | kernel ms per layer | collectives us per layer "
              "| kernels per layer |",
              "|---|---|---:|---:|---:|---:|"]
        if pl:
            L.append(f"| TP={tp} | :{pl['layers'][0]} / :{pl['layers'][1]} | {pl['step_ms']:.3f} | "
                     f"{pl['kernel_ms']:.3f} | {pl['collectives_us']:.1f} | {pl['kernels']:.0f} |")
        runs = sorted(one.values(), key=lambda r: _preset_layers(r) or 0)
        if len(runs) >= 2:
            g = per_layer(runs[-1], runs[0])
            if g:
                L.append(f"| one GPU (TP=1) | :{g['layers'][0]} / :{g['layers'][1]} | {g['step_ms']:.3f} | "
                         f"{g['kernel_ms']:.3f} | {g['collectives_us']:.1f} | {g['kernels']:.0f} |")
        srcs = [x for x in (prof, s.get("shallow"), *runs) if x]
        L += [""] + [f"- {_source(meta, x, None)}" for x in srcs] + [""]
    if spec:
        from bench_speculative import table

        L += ["## MTP 3/1/4 against plain decoding, simulated acceptance", "",
              _source(meta, spec, "python3 benchmarks/scripts/bench_speculative.py " + " ".join(spec.get("args", []))),
              ""]
        if spec.get("plain") and spec.get("speculative"):
            L += table(spec["plain"], spec["speculative"])
            L += ["", f"Start-up: plain {spec['plain'].get('startup_s', 0):.1f} s, MTP "
                      f"{spec['speculative'].get('startup_s', 0):.1f} s.", ""]
        else:
            L += ["(incomplete: the speculative engine did not finish)", ""]
    if serve:
        L += serve_table(serve, meta)
    L += parts_table(s)
    return "\n".join(L).rstrip() + "\n"


def startup_table(s: dict) -> list[str]:
    rows = []
    prof, shallow, spec, serve = s.get("profile"), s.get("shallow"), s.get("speculative"), s.get("serve")
    if prof:
        rows.append((f"profile_tp {prof['model']} (the call's first start: cold when the compile caches were empty)",
                     prof.get("startup_s"), prof.get("kv_total_tokens")))
    if serve:
        rows.append(("minidsa serve, process start to /health 200 (MTP 3/1/4)", serve.get("ready_s"),
                     serve.get("kv_total_tokens")))
    if spec:
        if spec.get("plain"):
            rows.append(("bench_speculative plain (the profile's engine flags again: warm caches)",
                         spec["plain"].get("startup_s"), None))
        sp = spec.get("speculative") or {}
        for L, t in (sp.get("startups_s") or {"": sp.get("startup_s")}).items():
            rows.append((f"bench_speculative {sp.get('label', 'MTP')}{f', simulated L = {L}' if L else ''}", t, None))
    if shallow:
        rows.append((f"profile_tp {shallow['model']} (shallow)", shallow.get("startup_s"),
                     shallow.get("kv_total_tokens")))
    if not rows:
        return []
    L = ["## Start-up and KV capacity", "", "In the section's default order (profile, serve, spec, shallow). The compile "
         "caches fill as the call goes: the profile's start is cold when the machine is fresh, later starts reuse "
         "what earlier ones compiled (the MTP graphs are first compiled by the serve part's start).",
         "", "| engine | start-up s | KV capacity, tokens |", "|---|---:|---:|"]
    L += [f"| {a} | {_f(b, 1)} | {'-' if c is None else int(c)} |" for a, b, c in rows]
    L += ["", "Start-up = the engine's construction (weights, KV cache, capture, warm-up; the ranks start inside it); "
          "each run's device, date, commit and command are with its own table on this page. KV capacity: the "
          "automatic one (the smallest any rank's free memory allows)."]
    return L + [""]


def category_tables(prof: dict, meta: dict) -> list[str]:
    from profile_tp import CATEGORY_NAMES

    batches = prof["batches"]
    L = ["## Where the step goes: kernels per category (rank 0)", "", _source(meta, prof, None), "",
         "| category | " + " | ".join(f"batch {b['batch']}: per step / us / % of step" for b in batches) + " |",
         "|---|" + "---:|" * len(batches)]
    for name in CATEGORY_NAMES:
        cells = []
        for b in batches:
            c = b["profile"]["categories"][name]
            cells.append(f"{c['count_per_step']:.1f} / {c['us_per_step']:.1f} / {100 * c['share_of_step']:.1f}%")
        L.append(f"| {name} | " + " | ".join(cells) + " |")
    L.append("| **gap** (step - busy) | " + " | ".join(
        f"- / {1e3 * b['profile']['gap_ms']:.1f} / {100 * b['profile']['gap_ms'] / b['profile']['step_ms']:.1f}%"
        for b in batches) + " |")
    L.append("| **profiled step** | " + " | ".join(
        f"{b['profile']['kernels_per_step']:.0f} / {1e3 * b['profile']['step_ms']:.1f} / 100%" for b in batches) + " |")
    L += ["", "Categories by kernel name (benchmarks/scripts/profile_tp.py, `CATEGORIES`); collectives on rank 0 "
          "include the wait for the slowest rank."]
    for rank, per in sorted((prof.get("ranks") or {}).items(), key=lambda kv: int(kv[0])):
        L += ["", f"Rank {rank}: " + "; ".join(
            f"batch {bs}: kernels {p['kernel_ms']:.3f} ms, collectives "
            f"{p['categories']['collectives']['us_per_step']:.1f} us, gap {p['gap_ms']:.3f} ms"
            for bs, p in sorted(per.items(), key=lambda kv: int(kv[0])))]
    for b in batches:
        L += ["", f"### Top-20 kernels, batch {b['batch']}", "",
              "| kernel | category | per step | us per step | % of kernel time | % of step |",
              "|---|---|---:|---:|---:|---:|"]
        L += [f"| `{k['name'][:100]}` | {k['category']} | {k['per_step']:.1f} | {k['us_per_step']:.1f} | "
              f"{100 * k['share']:.1f}% | {100 * k.get('share_of_step', 0):.1f}% |" for k in b["profile"]["top"]]
    return L + [""]


def serve_table(r: dict, meta: dict) -> list[str]:
    b = r.get("bench") or {}
    after = r.get("after") or {}
    L = ["## The guides' recipe through `minidsa serve`", "",
         _source(meta, {}, r.get("command")) + f"; driven by `{r.get('bench_command', '?')}`", "",
         "| check | result |", "|---|---|"]
    for name, ok in (r.get("checks") or {}).items():
        L.append(f"| {name.replace('_', ' ')} | {'yes' if ok else '**NO**'} |")
    L += [f"| **all** | {'passed' if r.get('ok') else '**FAILED**'} |", "",
          "| measure | value |", "|---|---|",
          f"| requests completed / failed | {b.get('completed', '-')} / {b.get('failed', '-')} |",
          f"| output tok/s | {_f(b.get('output_tokens_per_s'), 0)} |",
          f"| TTFT p50 / p99 s | {_f((b.get('ttft_s') or {}).get('p50'))} / {_f((b.get('ttft_s') or {}).get('p99'))} |",
          f"| ITL p50 / p99 ms | {_f(1e3 * (b.get('itl_s') or {}).get('p50', float('nan')), 2)} / "
          f"{_f(1e3 * (b.get('itl_s') or {}).get('p99', float('nan')), 2)} |",
          f"| ready (process start to /health 200) s | {_f(r.get('ready_s'), 1)} |",
          f"| KV capacity, tokens | {'-' if r.get('kv_total_tokens') is None else int(r['kv_total_tokens'])} |",
          f"| KV in use after the run, tokens | {after.get('kv_cache_used_tokens', '-')} |",
          f"| SIGTERM to exit s (limit 10) | {_f(r.get('exit_s'), 2)} |",
          f"| processes left / GPU compute processes | {len(r.get('minidsa_processes_left') or [])} / "
          f"{'-' if r.get('gpu_compute_processes') is None else len(r['gpu_compute_processes'])} |"]
    if r.get("error"):
        L.append(f"| error | {r['error']} |")
    return L + [""]


def parts_table(s: dict) -> list[str]:
    parts = s.get("parts") or {}
    if not parts:
        return []
    L = ["## Parts of the call", "", "| part | exit status | seconds | limit s |", "|---|---:|---:|---:|"]
    for name, p in parts.items():
        if p.get("skipped") and p.get("reason", "budget") == "budget":
            L.append(f"| {name} | skipped ({p.get('left', '?')} s of the budget left) | | |")
        elif p.get("skipped"):
            L.append(f"| {name} | skipped ({p['reason']}) | | |")
        else:
            L.append(f"| {name} | {p.get('rc', '?')} | {p.get('seconds', '?')} | {p.get('limit', '?')} |")
    return L + [""]


def run_page(doc: str, collect_raw, render, argv: list[str] | None = None, indent: int = 2) -> int:
    """A page script's command line (this one's, dp_attention_page.py's, eight_gpu_page.py's): with --collect, gather
    a section's raw outputs (`collect_raw`) into --json, else read --json; write `render(summary)` to --markdown, or
    print it."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--collect", metavar="RAW_DIR", help="gather the parts' outputs from this folder into --json first")
    p.add_argument("--json", required=True, help="the summary JSON (written with --collect, else read)")
    p.add_argument("--markdown", help="write the page here (default: print it)")
    args = p.parse_args(argv)
    if args.collect:
        summary = collect_raw(args.collect)
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=indent)
    else:
        summary = _load(args.json)
        if summary is None:
            print(f"cannot read {args.json}", file=sys.stderr)
            return 1
    text = render(summary)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(text)
    else:
        print(text)
    return 0


def main() -> int:
    return run_page(__doc__, collect, page)

if __name__ == "__main__":
    sys.exit(main())
