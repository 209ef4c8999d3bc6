"""Does programmatic dependent launch shorten a CUDA graph of short Triton kernels on this GPU? (benchmarks/archive/TAIL.md
section 8.) The same chains (tiny elementwise kernels, 10.5 MB FP8 GEMVs, both alternating) captured without PDL, with
PDL, with PDL and an early trigger, and with an L2 prefetch of each program's weight rows before the wait.

    python benchmarks/scripts/pdl_probe.py out.json   # ~10 s on an H100
"""

import json
import sys

import torch
import triton
import triton.language as tl


@triton.jit
def gemv(w_ptr, x_ptr, y_ptr, N, K: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, PDL: tl.constexpr,
         EARLY: tl.constexpr, PREFETCH: tl.constexpr = 0):
    if PREFETCH:  # one L2 prefetch per PREFETCH bytes of this program's weight rows, before waiting
        lines = tl.arange(0, BN * K // PREFETCH)
        tl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l",
                                  [w_ptr + tl.program_id(0) * BN * K + lines * PREFETCH], dtype=tl.int32,
                                  is_pure=False, pack=1)
    if PDL:
        if EARLY:
            tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    rn = tl.program_id(0) * BN + tl.arange(0, BN)
    acc = tl.zeros((BN,), tl.float32)
    for k0 in range(0, K, BK):
        rk = k0 + tl.arange(0, BK)
        w = tl.load(w_ptr + rn[:, None] * K + rk[None, :]).to(tl.float32)
        x = tl.load(x_ptr + rk).to(tl.float32)
        acc += tl.sum(w * x[None, :], 1)
    tl.store(y_ptr + rn, acc.to(tl.bfloat16))


@triton.jit
def small(x_ptr, y_ptr, n, B: tl.constexpr, PDL: tl.constexpr, EARLY: tl.constexpr):
    if PDL:
        if EARLY:
            tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    r = tl.program_id(0) * B + tl.arange(0, B)
    m = r < n
    tl.store(y_ptr + r, (tl.load(x_ptr + r, mask=m) * 0.5).to(tl.bfloat16), mask=m)


def main(path: str) -> None:
    print("triton", triton.__version__, "torch", torch.__version__, torch.cuda.get_device_name())
    k_dim, n_rows = 4096, 2560  # 2560 x 4096 e4m3 = 10.5 MB per GEMV
    weights = [torch.randn(n_rows, k_dim, device="cuda").to(torch.float8_e4m3fn) for _ in range(6)]
    bufs = [torch.zeros(k_dim, device="cuda", dtype=torch.bfloat16) for _ in range(3)]

    def chain(pdl: bool, early: bool, kind: str, prefetch: int) -> None:
        kw = dict(launch_pdl=True) if pdl else {}
        for i in range(60):
            if kind in ("small", "mixed"):
                small[(4,)](bufs[0], bufs[1], k_dim, B=1024, PDL=pdl, EARLY=early, num_warps=4, **kw)
            if kind in ("gemv", "mixed"):
                gemv[(n_rows // 32,)](weights[i % 6], bufs[1], bufs[2], n_rows, K=k_dim, BN=32, BK=256, PDL=pdl,
                                      EARLY=early, PREFETCH=prefetch, num_warps=4, **kw)

    variants = ((False, False, 0), (True, False, 0), (True, True, 0), (True, False, 128), (True, False, 256),
                (False, False, 128))
    res = {}
    for kind in ("small", "gemv", "mixed"):
        for pdl, early, prefetch in variants:
            if prefetch and kind == "small":
                continue
            chain(pdl, early, kind, prefetch)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.stream(torch.cuda.Stream()), torch.cuda.graph(graph):
                chain(pdl, early, kind, prefetch)
            for _ in range(5):
                graph.replay()
            torch.cuda.synchronize()
            times = []
            for _ in range(20):
                a, b = torch.cuda.Event(True), torch.cuda.Event(True)
                a.record()
                graph.replay()
                b.record()
                torch.cuda.synchronize()
                times.append(a.elapsed_time(b) * 1000)
            median = sorted(times)[len(times) // 2]
            res[f"{kind} pdl={pdl} early={early} prefetch={prefetch}"] = median
            print(kind, "pdl", pdl, "early", early, "prefetch", prefetch, f"median {median:.1f} us per graph",
                  flush=True)
    with open(path, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
