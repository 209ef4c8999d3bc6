"""Start-up on a GPU (issue 28): DeepGEMM's GEMM kernels compiled by the pool of processes, then only loaded by
the engine's process; the compile cache filled by one start and used by the next.

Each case runs in fresh processes: DeepGEMM's JIT reads its cache directory once per process, and inductor's
caches live in memory too. Run by `bash scripts/gpu_check.sh startup_tests` (DEEPGEMM=on for the first case).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _child(code: str, env: dict[str, str | None], timeout: float = 540) -> tuple[dict, str]:
    """Run `code` in a fresh python with `env` (None: unset); its last stdout line is JSON."""
    full = {k: v for k, v in {**os.environ, **env}.items() if v is not None}
    full["PYTHONPATH"] = os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=full,
                       timeout=timeout, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-4000:]
    return json.loads(r.stdout.strip().splitlines()[-1]), r.stderr


POOL = """
    import json, torch
    from minidsa.kernels import deepgemm, fp8
    from minidsa.kernels.deepgemm_warmup import GemmWarmUp, cached_kernels
    dev = torch.device("cuda")
    module, status = deepgemm.probe(dev, deepgemm.GEMM_API)
    if not status.available:
        print(json.dumps({"skip": status.reason}))
        raise SystemExit
    library = deepgemm.DeepGEMM(module, status, dev)
    g = torch.Generator(device=dev).manual_seed(0)
    # DeepSeek-V3.2's shared expert gate|up and down projections
    weights = [fp8.quant_block(torch.randn(n, k, device=dev, generator=g) * 0.02) for n, k in ((4096, 7168), (7168, 2048))]
    jit = GemmWarmUp(weights, 512, dev, library, workers=4)  # (MINIDSA_DEEPGEMM_WORKERS is read by config.resolve)
    pool = jit.compile_in_pool(progress=False)
    after_pool = len(cached_kernels())
    load = jit.load()
    errors = []
    for (w, s), m in ((weights[0], 17), (weights[0], 300), (weights[1], 129), (weights[1], 512)):
        x = torch.randn(m, w.shape[1], device=dev, generator=g).bfloat16()
        y = deepgemm.fp8_gemm_nt(module, x, w, s)
        want = fp8.w8a8_block_matmul_reference(x.float(), w, s)
        errors.append(((y.float() - want).norm() / want.norm()).item())
    again = GemmWarmUp(weights, 512, dev, library).compile_in_pool(progress=False)
    print(json.dumps({"tasks": len(jit.tasks), "pool": pool, "failures": jit.pool_failures, "after_pool": after_pool,
                      "after_load": len(cached_kernels()), "load": load, "errors": errors, "again": again,
                      "failed": library.failures}))
"""


def test_deepgemm_pool_compiles_every_kernel_and_the_engine_process_only_loads(tmp_path):
    got, err = _child(POOL, {"DG_JIT_CACHE_DIR": str(tmp_path / "dg")})
    if "skip" in got:
        pytest.skip(f"DeepGEMM's GEMM not usable here: {got['skip']}")
    assert not got["failures"], got
    assert f"{got['tasks']} GEMM classes on 4 processes" in got["pool"] and got["after_pool"] > 0, got
    assert got["after_load"] == got["after_pool"] and "0 kernels compiled in this process" in got["load"], got
    assert not got["failed"] and max(got["errors"]) < 0.02, got
    assert "were built before" in got["again"], got  # the manifest: the next start skips the pool


GROUPED = """
    import json, torch
    from minidsa.kernels import deepgemm, fp8
    from minidsa.kernels.deepgemm_warmup import GemmWarmUp, cached_kernels
    from minidsa.kernels.fused_moe import fused_moe_reference
    dev = torch.device("cuda")
    module, status = deepgemm.probe(dev, deepgemm.GEMM_API)
    if not status.available or deepgemm.grouped_contiguous(module) is None:
        print(json.dumps({"skip": status.reason or "no contiguous grouped GEMM"}))
        raise SystemExit
    library = deepgemm.DeepGEMM(module, status, dev)
    g = torch.Generator(device=dev).manual_seed(0)
    E, K, H, I = 8, 2, 1024, 512  # the grouped GEMM serves 512 tokens and more (128 pairs per expert)
    gate_up = fp8.quant_block(torch.randn(E, 2 * I, H, device=dev, generator=g) * H**-0.5)
    down = fp8.quant_block(torch.randn(E, H, I, device=dev, generator=g) * I**-0.5)
    jit = GemmWarmUp([], 640, dev, library, workers=2, experts=[(gate_up, down, K, True)])
    pool = jit.compile_in_pool(progress=False)
    load = jit.load()
    before = cached_kernels()
    errors, rows = [], []
    for tokens in (512, 577, 640):
        x = torch.randn(tokens, H, device=dev, generator=g).bfloat16()
        ids = torch.rand(tokens, E, device=dev, generator=g).topk(K, dim=1).indices.to(torch.int32)
        w = torch.rand(tokens, K, device=dev, generator=g)
        w = w / w.sum(1, keepdim=True)
        got = deepgemm.moe_contiguous(module, x, ids, w, gate_up[0], down[0], gate_up[1], down[1])
        want = fused_moe_reference(x.float(), ids.long(), w, gate_up[0], down[0], gate_up[1], down[1])
        errors.append(((got.float() - want).norm() / want.norm()).item())
        counts = torch.bincount(ids.flatten(), minlength=E)
        rows.append(int((-(-counts // 128) * 128).sum()))
    print(json.dumps({"pool": pool, "failures": jit.pool_failures, "load": load, "errors": errors, "rows": rows,
                      "classes": [c[0] for t in jit.grouped for c in t.classes()],
                      "compiled_serving": len(cached_kernels() - before)}))
"""


def test_deepgemm_pool_builds_the_grouped_gemm_rows_and_serving_compiles_none(tmp_path):
    """The pool runs the routed experts' grouped GEMM at every row count (all rows padding) on the real DeepGEMM;
    the MoE served afterwards at sizes in range compiles nothing and equals the reference."""
    got, err = _child(GROUPED, {"DG_JIT_CACHE_DIR": str(tmp_path / "dg")})
    if "skip" in got:
        pytest.skip(f"DeepGEMM's grouped GEMM not usable here: {got['skip']}")
    assert not got["failures"] and "grouped-GEMM row counts on 2 processes" in got["pool"], got
    assert "grouped" not in got["load"], got  # nothing left for the warm-up to run
    assert set(got["rows"]) <= set(got["classes"]) and got["compiled_serving"] == 0, got
    assert max(got["errors"]) < 0.03, got


ENGINE = """
    import json, logging
    logging.basicConfig(level=logging.WARNING)
    lines = []
    class Keep(logging.Handler):
        def emit(self, record):
            lines.append(record.getMessage())
    startup = logging.getLogger("minidsa.exec.startup")
    startup.setLevel(logging.INFO)
    startup.addHandler(Keep())
    from minidsa import LLM, SamplingParams
    # A fixed KV size: the caches are static shapes of the compiled graphs (auto sizing follows free memory).
    llm = LLM(model="tiny", progress=False, max_total_tokens=65536, max_running_requests=8, cuda_graph_max_bs=8)
    out = llm.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=4, ignore_eos=True, detokenize=False))
    print(json.dumps({"lines": lines, "tokens": out[0].token_ids}))
"""


def test_second_start_loads_the_artifacts_and_hits_the_inductor_cache(tmp_path):
    cache = tmp_path / "cache"
    env = {"MINIDSA_CACHE_DIR": str(cache), "TORCHINDUCTOR_CACHE_DIR": None, "TRITON_CACHE_DIR": None,
           "DG_JIT_CACHE_DIR": None}
    first, _ = _child(ENGINE, env)
    text = "\n".join(first["lines"])
    for phase in ("weights", "KV cache", "compile cache", "capture", "warm-up", "compile cache save"):
        assert f"start-up: {phase} " in text, text
    assert "saved" in text and os.listdir(cache / "artifacts"), text
    assert os.listdir(cache / "inductor") and os.listdir(cache / "triton"), text
    second, _ = _child(ENGINE, env)
    text2 = "\n".join(second["lines"])
    assert "loaded" in next(x for x in second["lines"] if x.startswith("start-up: compile cache ")), text2
    capture = next(x for x in second["lines"] if x.startswith("start-up: capture "))
    assert "inductor cache" in capture and "/ 0 misses" in capture, text2  # every compiled graph from the cache
    assert second["tokens"] == first["tokens"]


DEEPGEMM_LOG = """
    import json, logging
    logging.basicConfig(level=logging.WARNING)
    records = []
    class Keep(logging.Handler):
        def emit(self, record):
            records.append((record.levelname, record.name, record.getMessage()))
    logging.getLogger("minidsa").addHandler(Keep())
    logging.getLogger("minidsa.kernels.deepgemm_warmup").setLevel(logging.INFO)
    from minidsa import LLM, SamplingParams
    from minidsa.kernels import deepgemm
    _, status = deepgemm.probe("cuda", deepgemm.GEMM_API)
    if not status.available:
        print(json.dumps({"skip": status.reason}))
        raise SystemExit(0)
    # bench-dsv32 (FP8 weights) with the MTP layer (speculation) and automatic KV sizing: the activation profile
    # runs beside a fresh pool, so some of its classes are still building when it reaches them.
    llm = LLM(model="bench-dsv32:4", progress=False, max_running_requests=8, cuda_graph_max_bs=8,
              speculative_num_steps=2, enable_compile=False)
    assert llm.engine.runner.kernels.fp8_gemm == "deepgemm", llm.engine.runner.kernels
    out = llm.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=4, ignore_eos=True, detokenize=False))
    print(json.dumps({"records": records, "tokens": out[0].token_ids}))
"""


def test_deepgemm_start_up_says_once_at_info_which_shapes_it_serves(tmp_path):
    """Issue 48: classes the pool had not built when the activation profile reached them came out as one WARNING
    per shape ('Triton GEMM serves (8192, 7168) x (2240, 7168) (DeepGEMM: a shape or dtype it does not take)').
    Now: no per-shape warning, and one INFO line naming the shapes DeepGEMM serves (the fused q_a|wk|kv_a among
    them) and the profile's classes Triton ran meanwhile."""
    got, err = _child(DEEPGEMM_LOG, {"DG_JIT_CACHE_DIR": str(tmp_path / "dg")})
    if "skip" in got:
        pytest.skip(f"DeepGEMM's GEMM not usable here: {got['skip']}")
    records = got["records"]
    per_shape = [m for level, _, m in records if "Triton GEMM serves" in m and level != "DEBUG"]
    assert not per_shape, per_shape
    lines = [(level, m) for level, _, m in records if m.startswith("DeepGEMM FP8 GEMMs")]
    assert len(lines) == 1 and lines[0][0] == "INFO", records
    assert "DeepGEMM serves" in lines[0][1] and "2240x7168" in lines[0][1], lines  # 1536 + 128 + 576 rows
    print("\n" + lines[0][1])  # for the record: which classes the profile ran on Triton beside the pool
    assert got["tokens"] and len(got["tokens"]) == 4
