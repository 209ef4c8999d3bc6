#!/usr/bin/env bash
# On the GPU machine: build FlashMLA's sparse kernels (SM90: sparse FP8 decode, sparse bf16 prefill) from the
# folder scripts/prepare_flashmla.sh assembled, then print the line to source:
#
#   eval "$(bash scripts/build_flashmla.sh .fmla)"      # then `import flash_mla` works
#
# Only what the sparse interfaces link is compiled: FlashMLA's dense decode and its SM100 dense prefill /
# backward are left out (they are not compared), and only sm_90a code is generated (the SM100 sparse kernels'
# bodies compile to nothing there; their host-side launchers are needed to link). A binding of our own exposes
# `sparse_decode_fwd` and `sparse_prefill_fwd` as `flash_mla.cuda`, which FlashMLA's Python interface calls.
# FLASHMLA_BUILD_DIR (default /tmp/flashmla) keeps the build: a build cut short resumes there (ninja).
# To skip the build next time on the same torch, bring `$FLASHMLA_BUILD_DIR/flash_mla/cuda*.so` back and put it
# (any name ending in .so) in CARRIED_DIR/prebuilt/.
set -eu
here=$(cd "$1" && pwd)
dst=${FLASHMLA_BUILD_DIR:-/tmp/flashmla}
if [ ! -f "$dst/.built" ]; then
  [ -d "$dst/csrc" ] || { mkdir -p "$dst" && cp -r "$here/src/." "$dst/"; }
  if ls "$here"/prebuilt/*.so >/dev/null 2>&1; then
    suffix=$(python3 -c "import sysconfig; print(sysconfig.get_config_var('EXT_SUFFIX'))")
    cp "$(ls "$here"/prebuilt/*.so | head -1)" "$dst/flash_mla/cuda$suffix"
  else
    python3 -m pip install -q --no-index --no-deps --target "$dst/_tools" "$here"/ninja-*.whl >&2 || true
    export PATH="$dst/_tools/bin:$PATH" PYTHONPATH="$dst/_tools${PYTHONPATH:+:$PYTHONPATH}"
    [ -f "$dst/csrc/api/sparse_only.cpp" ] || cat > "$dst/csrc/api/sparse_only.cpp" <<'CPP'
// minidsa: bind FlashMLA's two sparse entry points only (the dense ones are not built).
#include <pybind11/pybind11.h>

#include "sparse_fwd.h"
#include "sparse_decode.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.def("sparse_decode_fwd", &sparse_attn_decode_interface);
    m.def("sparse_prefill_fwd", &sparse_attn_prefill_interface);
}
CPP
    [ -f "$dst/setup_sparse.py" ] || cat > "$dst/setup_sparse.py" <<'PY'
import os
from pathlib import Path

from setuptools import setup
from torch.utils.cpp_extension import BuildExtension, CUDAExtension

root = Path(__file__).resolve().parent
sources = ["csrc/api/sparse_only.cpp",
           "csrc/smxx/decode/get_decoding_sched_meta/get_decoding_sched_meta.cu",
           "csrc/smxx/decode/combine/combine.cu",
           "csrc/sm90/prefill/sparse/fwd.cu"]
sources += [str(p.relative_to(root)) for d in ("csrc/sm90/decode/sparse_fp8", "csrc/sm90/prefill/sparse",
                                               "csrc/sm100/decode/head64", "csrc/sm100/prefill/sparse")
            for p in sorted((root / d).rglob("instantiations/*.cu"))]
nvcc = ["-O3", "-std=c++20", "-DNDEBUG", "-D_USE_MATH_DEFINES", "-Wno-deprecated-declarations",
        "-U__CUDA_NO_HALF_OPERATORS__", "-U__CUDA_NO_HALF_CONVERSIONS__", "-U__CUDA_NO_HALF2_OPERATORS__",
        "-U__CUDA_NO_BFLOAT16_CONVERSIONS__", "--expt-relaxed-constexpr", "--expt-extended-lambda",
        "--use_fast_math", "-gencode", "arch=compute_90a,code=sm_90a",
        "--threads", os.environ.get("NVCC_THREADS", "4")]
include = [root / "csrc", root / "csrc/kerutils/include", root / "csrc/sm90", root / "csrc/cutlass/include",
           root / "csrc/cutlass/tools/util/include"]
setup(name="flash_mla", ext_modules=[CUDAExtension(
          "flash_mla.cuda", sources, include_dirs=[str(p) for p in include],
          extra_compile_args={"cxx": ["-O3", "-std=c++20", "-DNDEBUG", "-Wno-deprecated-declarations"],
                              "nvcc": nvcc})],
      cmdclass={"build_ext": BuildExtension})
PY
    start=$(date +%s)
    ( cd "$dst" && MAX_JOBS=${MAX_JOBS:-16} python3 setup_sparse.py build_ext --inplace ) > "$dst/build.log" 2>&1 \
      || { tail -n 60 "$dst/build.log" >&2; echo "FlashMLA build failed (log: $dst/build.log)" >&2; exit 1; }
    echo "FlashMLA built in $(( $(date +%s) - start )) s" >&2
  fi
  touch "$dst/.built"
fi
PYTHONPATH="$dst${PYTHONPATH:+:$PYTHONPATH}" python3 -c \
  "import flash_mla, flash_mla.cuda as c; print('flash_mla imported from', c.__file__)" >&2
echo "export PYTHONPATH=$dst\${PYTHONPATH:+:\$PYTHONPATH}"
