#!/usr/bin/env bash
# On the CPU machine: assemble a folder from which scripts/build_flashmla.sh builds FlashMLA's sparse MLA
# kernels (SM90) on the GPU machine against its own torch, to time them beside ours (benchmarks/scripts/bench_mla.py).
#
#   bash scripts/prepare_flashmla.sh FLASHMLA_GIT_DIR CUTLASS_GIT_DIR OUT_DIR
#
# FLASHMLA_GIT_DIR: a git dir of deepseek-ai/FlashMLA (the `fetch` tool's mirror works); CUTLASS_GIT_DIR: a
# git dir of NVIDIA/cutlass holding the commit FlashMLA pins as its csrc/cutlass submodule (only its include/
# and tools/util/include/ are taken). A pip-downloaded ninja wheel rides along (parallel compiles; the GPU
# machine reaches no index). OUT_DIR (about 30 MB) must stay out of git (.git/info/exclude, e.g. /.fmla/):
# never commit it; hand it to the GPU machine explicitly (the run tool's `carry`).
set -euo pipefail
fm=$1; cut=$2; out=$3
mkdir -p "$out" && out=$(cd "$out" && pwd)
rm -rf "$out/src" && mkdir -p "$out/src"
git --git-dir="$fm" archive HEAD csrc flash_mla | tar -x -C "$out/src"
pin=$(git --git-dir="$fm" ls-tree HEAD csrc/cutlass | awk '{print $3}')
rm -rf "$out/src/csrc/cutlass" && mkdir -p "$out/src/csrc/cutlass"
git --git-dir="$cut" archive "$pin" include tools/util/include | tar -x -C "$out/src/csrc/cutlass"
rm -f "$out"/ninja-*.whl
python3 -m pip download -q --no-deps --only-binary=:all: --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 -d "$out" ninja
{ echo "FlashMLA $(git --git-dir="$fm" rev-parse HEAD) ($(git --git-dir="$fm" log -1 --format=%ad --date=short HEAD))"
  echo "CUTLASS $pin (FlashMLA's pinned submodule)"; } > "$out/VERSIONS"
cat "$out/VERSIONS"
du -sh "$out"
