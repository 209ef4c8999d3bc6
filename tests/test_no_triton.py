"""A CPU-only install without Triton (no wheel for macOS): minidsa imports, `minidsa generate` and
`LLM().generate` run on the torch references, with the tokens of an install that has Triton."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

from minidsa import SamplingParams

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Every `import triton...` fails, as where it is not installed.
NO_TRITON = "import sys; sys.modules['triton'] = None\n"


def _python(code: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    env.pop("TRITON_INTERPRET", None)
    return subprocess.run([sys.executable, "-c", NO_TRITON + textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=300, env=env, cwd=ROOT)


def test_generate_without_triton_matches_the_install_with_it(tiny_llm):
    r = _python("""
        import json
        from minidsa import LLM, SamplingParams
        from minidsa.attention import select as choice
        from minidsa.kernels import custom_ops, fused_moe, triton_compat  # every kernel module imports
        out = LLM(device="cpu", dtype="float32", progress=False).generate(
            [[5, 6, 7, 8], "Hello"], SamplingParams(max_tokens=6, ignore_eos=True))
        print(json.dumps({"tokens": [o.token_ids for o in out], "missing": triton_compat.MISSING,
                          "usable": choice.triton_usable("cpu"), "triton": sys.modules["triton"] is None}))
    """)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["triton"] and "import triton failed" in got["missing"]
    assert got["usable"][0] is False and "import triton failed" in got["usable"][1]
    want = tiny_llm.generate([[5, 6, 7, 8], "Hello"], SamplingParams(max_tokens=6, ignore_eos=True))
    assert got["tokens"] == [o.token_ids for o in want]


def test_minidsa_generate_command_without_triton():
    r = _python("""
        from minidsa import cli
        sys.exit(cli.main(["generate", "--prompt", "Hello", "--max-tokens", "4", "--device", "cpu"]))
    """)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "output:" in r.stdout and "[length, 4 tokens]" in r.stdout


def test_a_triton_kernel_without_triton_refuses_to_launch_by_name():
    r = _python("""
        from minidsa.kernels import indexer
        try:
            indexer._paged_logits_kernel[(1,)]()
        except RuntimeError as e:
            print(e)
    """)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "Triton kernel _paged_logits_kernel cannot run: import triton failed" in r.stdout
