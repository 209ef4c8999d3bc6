"""The examples run as a user runs them: the notebook through a Jupyter kernel (nbclient), every script in
examples/ in a subprocess, stream_client.py against a live `minidsa serve` on a free local port, and
make_tiny_checkpoint.py's output loaded back with LLM.

Subprocesses get OMP_NUM_THREADS=1 (one intra-op thread, like conftest.py gives this process): on a busy
2-core machine more threads make the tiny model's small ops 10x slower.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(REPO, "examples")
NOTEBOOK = os.path.join(EXAMPLES, "quickstart.ipynb")
NOTEBOOK_BUDGET_S = 120  # the limit for the notebook on CPU


def example_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", os.environ.get("MINIDSA_TEST_THREADS", "1"))
    env.pop("MINIDSA_MODEL", None)
    # README commands type `minidsa ...`: the interpreter's bin directory first, as in an activated virtualenv
    # (tests start the CLI themselves as `python -m minidsa`, which needs no PATH).
    env["PATH"] = os.pathsep.join([os.path.dirname(sys.executable), env.get("PATH", "")])
    env.update(extra)
    return env


def run_script(args: list[str], timeout: float = 120, **env: str) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, *args], cwd=REPO, env=example_env(**env), capture_output=True,
                          text=True, timeout=timeout)
    assert proc.returncode == 0, f"{args} exited {proc.returncode}\n--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}"
    return proc


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 90) -> None:
    """Poll GET {url}/health until it answers 200; fail early if the server process exits."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"server exited with {proc.returncode} before answering /health")
        try:
            with urllib.request.urlopen(url.rstrip("/") + "/health", timeout=2) as resp:
                if resp.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
            pass
        time.sleep(0.3)
    raise AssertionError(f"server at {url} not healthy after {timeout} s")


def stop_process(proc: subprocess.Popen, timeout: float = 15) -> None:
    """SIGINT (graceful drain), then SIGKILL, to the process group the server was started in."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(5)


@contextlib.contextmanager
def running_server(cmd: list[str] | str, port: int, log_path: str, cwd: str = REPO,
                   env: dict[str, str] | None = None) -> Iterator[str]:
    """Start a server command in the background (own process group), yield its base URL once healthy,
    stop it afterwards. Its output goes to log_path (shown when it fails to come up)."""
    url = f"http://127.0.0.1:{port}"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, shell=isinstance(cmd, str), cwd=cwd, env=env or example_env(), stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
    try:
        try:
            wait_healthy(url, proc)
        except AssertionError as e:
            with open(log_path) as f:
                raise AssertionError(f"{e}\n--- server output\n{f.read()[-4000:]}") from None
        yield url
    finally:
        stop_process(proc)


# -- notebook ---------------------------------------------------------------------------------------------

def ensure_python3_kernel() -> str:
    """nbclient starts kernels by name; ipykernel serves "python3" natively, but install the spec if a
    jupyter setup lacks it."""
    from jupyter_client.kernelspec import KernelSpecManager, NoSuchKernel

    try:
        KernelSpecManager().get_kernel_spec("python3")
    except NoSuchKernel:
        from ipykernel.kernelspec import install

        install(user=True, kernel_name="python3")
    return "python3"


def test_notebook_committed_without_outputs():
    import nbformat

    nb = nbformat.read(NOTEBOOK, as_version=4)
    nbformat.validate(nb)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code, "notebook has no code cells"
    dirty = [i for i, c in enumerate(code) if c.outputs or c.execution_count is not None]
    assert not dirty, f"code cells {dirty} carry outputs: clear them before committing"


def _cell_texts(cell) -> str:
    parts = []
    for o in cell.outputs:
        if o.output_type == "stream":
            parts.append(o.text)
        elif "data" in o and "text/plain" in o.data:
            parts.append(o.data["text/plain"])
    return "".join(parts)


def execute_notebook(tmp_path, model: str | None) -> tuple[list, float]:
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(NOTEBOOK, as_version=4)
    client = NotebookClient(nb, timeout=NOTEBOOK_BUDGET_S, kernel_name=ensure_python3_kernel(),
                            resources={"metadata": {"path": str(tmp_path)}})
    # The kernel inherits this process's environment: one thread, and the model parameter.
    patched = {"OMP_NUM_THREADS": os.environ.get("MINIDSA_TEST_THREADS", "1"), "MINIDSA_MODEL": model or "",
               "MPLBACKEND": "module://matplotlib_inline.backend_inline"}
    saved = {k: os.environ.get(k) for k in patched}
    os.environ.update(patched)
    try:
        start = time.perf_counter()
        client.execute()  # raises CellExecutionError naming the failing cell
        elapsed = time.perf_counter() - start
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return nb.cells, elapsed


def check_notebook_outputs(cells: list, elapsed: float) -> str:
    code = [c for c in cells if c.cell_type == "code"]
    errors = [o for c in code for o in c.outputs if o.output_type == "error"]
    assert not errors, errors
    assert elapsed < NOTEBOOK_BUDGET_S, f"notebook took {elapsed:.0f} s"
    text = "\n".join(_cell_texts(c) for c in code)
    images = sum("image/png" in o.get("data", {}) for c in code for o in c.outputs)
    assert images >= 3, f"expected the heatmap, schedule and benchmark plots, got {images} images"
    assert "positions per token, causal=True" in text  # the indexer recording was read back
    assert "batch 8:" in text and "tok/s" in text  # the benchmark ran
    return text


def test_notebook_runs_on_embedded_model(tmp_path):
    cells, elapsed = execute_notebook(tmp_path, None)
    text = check_notebook_outputs(cells, elapsed)
    assert "minidsa-tiny" in text
    assert "lossless (greedy tokens identical with and without speculation): True" in text
    assert re.search(r"bench-glm5 preset +3/4 full: F F F s", text), text


def test_notebook_runs_on_a_checkpoint(tmp_path, glm_checkpoint):
    """MINIDSA_MODEL points the notebook at a checkpoint: here a GLM one whose layers 1 and 3 share top-k."""
    cells, elapsed = execute_notebook(tmp_path, glm_checkpoint)
    text = check_notebook_outputs(cells, elapsed)
    assert re.search(r"this model \(glm_moe_dsa\) +2/4 full: F s F s", text), text
    assert "lossless (greedy tokens identical with and without speculation): True" in text


# -- scripts ------------------------------------------------------------------------------------------------

def test_offline_batch():
    out = run_script(["examples/offline_batch.py", "--num-prompts", "4", "--max-tokens", "8"]).stdout
    assert "batched:    4 requests, 32 tokens" in out, out
    assert "greedy outputs identical batched vs sequential: 4/4" in out, out


def test_stream_client_against_live_server(tmp_path):
    port = free_port()
    cmd = [sys.executable, "-m", "minidsa", "serve", "--host", "127.0.0.1", "--port", str(port)]
    with running_server(cmd, port, str(tmp_path / "server.log")) as url:
        for extra in ([], ["--chat"]):
            proc = run_script(["examples/stream_client.py", "--url", url, "--prompt", "Hello", "--max-tokens", "6",
                               "--ignore-eos", *extra], timeout=60)
            assert proc.stdout.strip(), f"no streamed text ({extra}); stderr: {proc.stderr}"
            assert "finish_reason=length" in proc.stderr, proc.stderr
            assert "'completion_tokens': 6" in proc.stderr, proc.stderr


# -- make_tiny_checkpoint ------------------------------------------------------------------------------------

def make_checkpoint(out_dir: str, arch: str) -> str:
    proc = run_script(["examples/make_tiny_checkpoint.py", "--arch", arch, "--mtp", "--out", out_dir], timeout=180)
    path = proc.stdout.strip().splitlines()[-1]
    assert path == os.path.abspath(out_dir), proc.stdout
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "model.safetensors.index.json"):
        assert os.path.exists(os.path.join(path, name)), f"{name} missing in {os.listdir(path)}"
    return path


@pytest.fixture(scope="module")
def glm_checkpoint(tmp_path_factory):
    return make_checkpoint(str(tmp_path_factory.mktemp("ckpt") / "tiny-glm"), "glm_moe_dsa")


def _load_and_generate(path: str, arch: str) -> None:
    from minidsa import LLM, SamplingParams

    with open(os.path.join(path, "config.json")) as f:
        raw = json.load(f)
    assert raw["architectures"] == [{"deepseek_v32": "DeepseekV32ForCausalLM",
                                     "glm_moe_dsa": "GlmMoeDsaForCausalLM"}[arch]]
    llm = LLM(model=path, device="cpu", dtype="float32", progress=False)
    cfg = llm.engine.model_config
    assert cfg.architecture == arch and cfg.num_nextn_predict_layers == 1
    if arch == "glm_moe_dsa":
        assert cfg.indexer_full == (True, False, True, False)
    prompt = llm.tokenizer.encode("Sparse attention picks the top-k keys. " * 12)
    assert len(prompt) > cfg.index_topk  # long enough that attention is actually sparse
    greedy = SamplingParams(max_tokens=8, ignore_eos=True)
    out = llm.generate([prompt, "hi"], greedy)
    assert [len(o.token_ids) for o in out] == [8, 8] and all(o.finish_reason == "length" for o in out)
    assert out[1].text, "the checkpoint's tokenizer decodes the output"
    chat = llm.chat([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=4))
    assert chat.token_ids
    # The MTP layer loads and drafts: speculative decoding gives the same greedy tokens.
    spec = LLM(model=path, device="cpu", dtype="float32", progress=False, speculative_num_steps=2)
    assert [o.token_ids for o in spec.generate([prompt, "hi"], greedy)] == [o.token_ids for o in out]
    assert spec.engine.metrics().spec_verify_steps_total > 0


def test_glm_checkpoint_loads_and_generates(glm_checkpoint):
    _load_and_generate(glm_checkpoint, "glm_moe_dsa")
    proc = subprocess.run([sys.executable, "-m", "minidsa", "generate", "--model", glm_checkpoint, "--prompt", "hi",
                           "--max-tokens", "4"],
                          cwd=REPO, env=example_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "output:" in proc.stdout, proc.stdout + proc.stderr


def test_deepseek_checkpoint_loads_and_generates(tmp_path):
    path = make_checkpoint(str(tmp_path / "tiny-dsv32"), "deepseek_v32")
    _load_and_generate(path, "deepseek_v32")
