"""Tensor parallelism on CPU (gloo): two processes produce exactly the tokens of one.

Each TP=2 engine spawns a real second process (slow on a small machine), so one engine per configuration
serves several checks: greedy tokens over prompts longer than index_topk, a second round that hits the prefix
cache, MTP speculation (a chain on DeepSeek-V3.2, a tree with KV compaction on GLM-5; drafts forced on both
ranks, see tp_forced_rank.py), expert parallelism with overlapped scheduling, prompt / sampled-token logprobs
through the vocab-parallel head. Plus: a killed rank ends the run with an error naming it, and the layers'
checkpoint slicing on its own (no processes).

Exits, each within a bound and with no rank left behind: leaving `with LLM(...)`, `LLM.close()` after an error
inside a step, a killed rank, and `minidsa serve --tp 2` stopped by SIGTERM (drained) or by a second SIGINT;
the ranks see the environment the machine set (NVLink multicast off).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import random
import signal
import sys
import time

import pytest
import torch

from harness import count_replays, ranks_run, read_sse, static_fast_paths
from hf_tiny import save_hf_with_mtp
from minidsa import LLM, SamplingParams
from minidsa.config import ConfigError, EngineConfig, ModelConfig
from minidsa.parallel.launch import TEARDOWN_S, RankFailedError
from minidsa.attention.select import triton_usable
from minidsa.common.plan import StepKind
from test_speculative import forced_override, run as run_with_forced_drafts
from tp_env_rank import ENV as RANK_ENV_REPORT
from tp_forced_rank import ENV as FORCED_DRAFTS_ENV
from tp_graph_rule import LIVE as GRAPHS_ALIVE, follow_nccl_graph_rule

GREEDY = SamplingParams(max_tokens=10, ignore_eos=True, detokenize=False)
COMMON = dict(device="cpu", dtype="float32", max_total_tokens=2048, max_running_requests=4, progress=False)


def checkpoint_with_mtp(arch: str, path: str) -> str:
    """A tiny HF checkpoint of `arch` plus random nextn-layer (MTP) weights."""
    over = dict(num_hidden_layers=3)
    if arch == "glm_moe_dsa":
        over.update(index_topk_freq=2, index_skip_topk_offset=1)
    return save_hf_with_mtp(arch, path, seed=7, **over)


def prompts_for(config: ModelConfig) -> list[list[int]]:
    """Longer than index_topk (sparse attention), two sharing a long prefix (prefix cache)."""
    rng = random.Random(3)
    k = config.index_topk
    shared = [rng.randint(2, config.vocab_size - 1) for _ in range(2 * k)]
    return [[rng.randint(2, config.vocab_size - 1) for _ in range(k + 5)], shared + [5, 6, 7], shared + [9]]


def generate(llm: LLM, prompts, params=GREEDY) -> list[list[int]]:
    return [o.token_ids for o in llm.generate(prompts, params)]


def count_overlapped_launches(engine) -> list[int]:
    """[steps launched (their plans broadcast) while an earlier step's result was still unread], counted from
    now on by wrapping the worker's launch and each pending step's result."""
    count, unread = [0], set()
    launch = engine.worker.launch

    def counting(plan):
        count[0] += bool(unread)
        pending = launch(plan)
        result, key = pending.result, id(pending)
        unread.add(key)

        def reading():
            unread.discard(key)
            return result()

        pending.result = reading
        return pending

    engine.worker.launch = counting
    return count


SPEC = {"deepseek_v32": dict(speculative_num_steps=2),
        "glm_moe_dsa": dict(speculative_num_steps=2, speculative_topk=2, speculative_num_draft_tokens=4)}


def force_rank_drafts(monkeypatch, tmp_path, reference: dict[str, list[int]], topk: int, seed: int) -> None:
    """Ranks > 0 started from now on run tests/tp_forced_rank.py: their drafts are forced as
    `forced_override(reference, topk, random.Random(seed))` forces rank 0's."""
    spec = tmp_path / "forced_drafts.json"
    spec.write_text(json.dumps({"reference": reference, "topk": topk, "seed": seed}))
    ranks_run(monkeypatch, tmp_path, "tp_forced_rank.py")
    monkeypatch.setenv(FORCED_DRAFTS_ENV, str(spec))


@pytest.mark.parametrize("arch", ["deepseek_v32", "glm_moe_dsa"])
def test_two_ranks_equal_one_process(arch, tmp_path, monkeypatch):
    path = checkpoint_with_mtp(arch, str(tmp_path / arch))
    single = LLM(path, **COMMON)
    prompts = prompts_for(single.engine.model_config)
    reference = generate(single, prompts)
    by_id = {f"r{i}": r for i, r in enumerate(reference)}
    topk = SPEC[arch].get("speculative_topk", 1)
    logprobs = SamplingParams(max_tokens=4, ignore_eos=True, detokenize=False, logprobs=True, top_logprobs=2,
                              prompt_logprobs=1)
    ref_lp = single.generate(prompts[:2], logprobs)

    # Tensor parallel + MTP speculation (lossless: the plain greedy tokens), twice: the second round reuses
    # cached prefixes, and its drafts are forced to the right tokens up to a random depth (on a non-first
    # tree branch), on both ranks alike, so long paths are accepted and the tree's KV compaction runs on both.
    with monkeypatch.context() as m:
        force_rank_drafts(m, tmp_path, by_id, topk, seed=0)
        tp = LLM(path, tensor_parallel_size=2, **SPEC[arch], **COMMON)
    with tp:
        assert generate(tp, prompts) == reference
        override = forced_override(by_id, topk, random.Random(0))
        assert run_with_forced_drafts(tp, prompts, GREEDY, override) == reference
        metrics = tp.engine.metrics()
        assert metrics.prefix_cache_hit_tokens_total > 0 and metrics.spec_accepted_tokens_total > 0
        tp.engine.check_no_leaks()

    # Expert parallelism: each rank holds half the routed experts. No speculator: overlapped scheduling, so
    # rank 0 broadcasts step N+1's plan while step N's tokens are pending.
    with LLM(path, tensor_parallel_size=2, enable_expert_parallel=True, **COMMON) as ep:
        experts = ep.engine.runner.model.model.layers[1].mlp.experts
        assert experts.num_local_experts == experts.n_experts // 2
        assert ep.engine.overlap
        overlapped = count_overlapped_launches(ep.engine)
        assert generate(ep, prompts) == reference
        assert overlapped[0] > 0
        for got, want in zip(ep.generate(prompts[:2], logprobs), ref_lp):
            assert got.token_ids == want.token_ids
            assert got.logprobs == pytest.approx(want.logprobs, abs=1e-4)
            assert got.prompt_logprobs[1:] == pytest.approx(want.prompt_logprobs[1:], abs=1e-4)
            assert [t.keys() for t in got.top_logprobs] == [t.keys() for t in want.top_logprobs]
        ep.engine.check_no_leaks()


def test_killed_rank_is_named_and_the_run_ends(tiny_llm):
    """Also: the random-weight preset at TP=2 is the one-process preset (drawn whole, then sharded), with a
    prompt whose plan is longer than the channel's first message (it follows in a second broadcast)."""
    import pickle

    from minidsa.parallel.channel import FIRST_MESSAGE_BYTES

    prompt = [[3 + 5 * i for i in range(40)], [(7 * i) % 900 + 2 for i in range(1500)]]
    llm = LLM(tensor_parallel_size=2, **COMMON)
    try:
        sizes = []
        launch = llm.engine.worker.launch
        llm.engine.worker.launch = lambda plan: (sizes.append(len(pickle.dumps(plan))), launch(plan))[1]
        assert generate(llm, prompt) == generate(tiny_llm, prompt)
        assert max(sizes) > FIRST_MESSAGE_BYTES
        del llm.engine.worker.launch
        child = llm.engine.runner.ranks.processes.procs[1]
        os.kill(child.pid, signal.SIGKILL)
        child.wait(30)
        started = time.monotonic()
        with pytest.raises(RankFailedError, match="rank 1 .*killed by signal 9"):
            generate(llm, [[5, 6, 7, 8]] * 2, SamplingParams(max_tokens=4, detokenize=False))
        assert time.monotonic() - started < 5  # named at once, not after a collective's timeout
    finally:
        started = time.monotonic()
        llm.close()
    assert time.monotonic() - started < 10
    # every process of the group is gone and a new group can start in this process
    assert llm.engine.runner.ranks.processes.procs[1].poll() is not None
    assert not torch.distributed.is_initialized()
    for rid in list(llm.engine.requests):  # the failed run's requests: nothing can serve them any more
        llm.engine.abort(rid, report=False)


# The variables the lent GPU machines set to keep NVLink multicast off (REFERENCE_NOTES.md, "Several GPUs"): every
# process minidsa starts must see them too.
MACHINE_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def test_leaving_with_llm_ends_every_rank_and_ranks_see_the_parent_environment(monkeypatch, tmp_path, caplog):
    """`with LLM(...)`: leaving the block stops rank 1 (a clean exit, code 0, not reported as a failure) and leaves
    the process groups within seconds; rank 1 saw this process's environment (NCCL_NVLS_ENABLE=0 and the rest), as
    reported by tests/tp_env_rank.py."""
    report = tmp_path / "rank_env.json"
    ranks_run(monkeypatch, tmp_path, "tp_env_rank.py")
    monkeypatch.setenv(RANK_ENV_REPORT, str(report))
    for name, value in MACHINE_ENV.items():
        monkeypatch.setenv(name, os.environ.get(name, value))
    with LLM(tensor_parallel_size=2, **COMMON) as llm:
        child = llm.engine.runner.ranks.processes.procs[1]
        assert len(generate(llm, [[5, 6, 7, 8, 9]])[0]) == GREEDY.max_tokens
        started = time.monotonic()
    assert time.monotonic() - started < 10
    assert child.poll() == 0
    assert not torch.distributed.is_initialized()
    time.sleep(0.2)  # the watch thread's poll interval: it would have reported rank 1's exit by now
    assert not [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and "minidsa" in r.name]
    seen = json.loads(report.read_text())
    assert {name: seen.get(name) for name in MACHINE_ENV} == {name: os.environ[name] for name in MACHINE_ENV}


def test_close_destroys_every_ranks_graphs_before_aborting_the_groups(monkeypatch, tmp_path):
    """NCCL aborts a communicator only once every CUDA graph that captured it is gone (tests/tp_graph_rule.py makes
    both ranks obey that on CPU, with a stand-in graph each). LLM.close() destroys each rank's graphs first, so both
    aborts return at once (one left waiting costs TEARDOWN_S), rank 1 exits 0 and this process's group is gone:
    another engine can start here."""
    ranks_run(monkeypatch, tmp_path, "tp_graph_rule.py")
    follow_nccl_graph_rule(monkeypatch.setattr)
    llm = LLM(tensor_parallel_size=2, **COMMON)
    child = llm.engine.runner.ranks.processes.procs[1]
    assert len(GRAPHS_ALIVE) == 1 and llm.engine.runner.graphs.captured
    assert len(generate(llm, [[5, 6, 7, 8, 9]])[0]) == GREEDY.max_tokens
    started = time.monotonic()
    llm.close()
    assert time.monotonic() - started < TEARDOWN_S
    assert child.poll() == 0
    assert not GRAPHS_ALIVE
    assert not torch.distributed.is_initialized()


def test_an_error_inside_a_step_ends_the_run_and_close_ends_every_rank(monkeypatch):
    """Rank 0's forward raises after the plan went to rank 1 (injected here, test-only): rank 1 waits in a
    collective rank 0 never joins, so the group cannot go on. The step raises RankFailedError naming rank 0's
    error, so does every later one (at once), and LLM.close() still ends rank 1 (code 0: it was stopped) within
    seconds."""
    llm = LLM(tensor_parallel_size=2, **COMMON)
    child = llm.engine.runner.ranks.processes.procs[1]
    try:
        generate(llm, [[5, 6, 7, 8]])

        def failing_forward(*args, **kwargs):
            raise ValueError("injected")

        monkeypatch.setattr(llm.engine.runner.model, "forward", failing_forward)
        with pytest.raises(RankFailedError, match=r"rank 0 failed inside a step \(ValueError: injected\)"):
            generate(llm, [[9, 10, 11]])
        started = time.monotonic()
        with pytest.raises(RankFailedError, match="out of step"):
            generate(llm, [[9, 10, 11]])
        assert time.monotonic() - started < 1
    finally:
        started = time.monotonic()
        llm.close()
    assert time.monotonic() - started < 10
    assert child.poll() == 0
    assert not torch.distributed.is_initialized()
    for rid in list(llm.engine.requests):  # the failed run's requests: nothing can serve them any more
        llm.engine.abort(rid, report=False)


def _gone(pid: int, within: float = 2.0) -> bool:
    """Whether process `pid` has ended (or is a zombie) within `within` s."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return True
        except OSError:
            return True
        time.sleep(0.05)
    return False


def _children(pid: int) -> list[int]:
    """Direct child processes of pid (Linux /proc): serve --tp 2's rank 1."""
    kids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    stat = f.read()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                kids.append(int(entry))
    return kids



def _serve(args: list[str], hook: str | None = None, env: dict[str, str] | None = None):
    """`minidsa serve --port 0 ARGS` (or tests/`hook` serve ...) started and listening -> (process, base url)."""
    import subprocess

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cmd = [sys.executable, os.path.join(root, "tests", hook)] if hook else [sys.executable, "-m", "minidsa"]
    path = os.environ.get("PYTHONPATH")  # kept: the GPU machine's carried wheels (msgspec) are on it
    env = dict(os.environ, PYTHONPATH=root + (os.pathsep + path if path else ""), OMP_NUM_THREADS="1", **(env or {}))
    proc = subprocess.Popen([*cmd, "serve", "--port", "0", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=root, env=env)
    line = proc.stdout.readline()
    if "serving" not in line:
        proc.kill()
        raise AssertionError((line, proc.communicate()[1]))
    return proc, line.strip().rsplit(" ", 1)[1]


SERVER_ENDINGS = ["sigterm-drain", "second-sigint", "rank-killed", "step-error", "stuck-teardown"]


def serve_and_end(how: str, *args: str) -> tuple[int, int]:
    """`minidsa serve --tp 2 ARGS` (the tiny preset) with a request streaming, ended `how`:
    - "sigterm-drain": SIGTERM; the request finishes (finish_reason length), the server exits 0;
    - "second-sigint": SIGINT twice; the request is aborted, the server exits 0;
    - "rank-killed": SIGKILL to rank 1; within 5 s the stream ends with an error naming it, the server exits 1
      with the reason on its last line;
    - "step-error": rank 0 raises inside a step (tests/tp_faults.py); the same, naming rank 0's error;
    - "stuck-teardown": SIGTERM drain as above, but aborting the process groups never returns (tests/tp_faults.py,
      as NCCL's teardown can hang): the bounded teardown is left behind and the server still exits 0.
    Either way within 10 s of the drain's end, the second signal or the error, and rank 1 is gone. Returns the
    server's and rank 1's pids (the GPU tests check that no GPU process of theirs remains)."""
    import tempfile

    import aiohttp

    from tp_faults import FAIL_STEP_GATE, HANG_ABORT

    drain = how in ("sigterm-drain", "stuck-teardown")
    gate = os.path.join(tempfile.mkdtemp(), "fail")
    faults = {"step-error": {FAIL_STEP_GATE: gate}, "stuck-teardown": {HANG_ABORT: "1"}}.get(how)
    proc, url = _serve(["--tp", "2", "--shutdown-timeout", "60", *args], hook="tp_faults.py" if faults else None,
                       env=faults)
    try:
        ranks = _children(proc.pid)
        assert len(ranks) == 1, ranks  # rank 1 (rank 0 is the server process)

        async def main():
            async with aiohttp.ClientSession() as session:
                body = {"prompt": "long", "max_tokens": 24 if drain else 3000, "ignore_eos": True, "stream": True}
                async with session.post(url + "/v1/completions", json=body) as resp:
                    assert resp.status == 200
                    assert (await resp.content.readline()).startswith(b"data: ")
                    started = time.monotonic()
                    if how == "rank-killed":
                        os.kill(ranks[0], signal.SIGKILL)
                    elif how == "step-error":
                        open(gate, "w").close()
                    else:
                        proc.send_signal(signal.SIGTERM if drain else signal.SIGINT)
                    if how == "second-sigint":
                        await asyncio.sleep(0.5)
                        proc.send_signal(signal.SIGINT)
                    events = await asyncio.wait_for(read_sse(resp), timeout=60)
                    return events, started, time.monotonic()

        events, started, ended = asyncio.run(main())
        code = proc.wait(timeout=30)
        took = time.monotonic() - ended
        err = proc.stderr.read()
        assert took < 10, (took, err[-2000:])
        if how in ("rank-killed", "step-error"):
            why = "rank 1" if how == "rank-killed" else "rank 0 failed inside a step (ValueError: injected step"
            errors = [e for e in events if isinstance(e, dict) and "error" in e]
            assert errors and why in errors[-1]["error"]["message"], events[-3:]
            assert ended - started < 5, (ended - started, err[-2000:])
            assert code == 1, err[-2000:]
            assert "shutting the server down" in err, err[-2000:]
            last = err.splitlines()[-1]
            assert "minidsa serve: error: the engine stopped" in last and why in last, err[-2000:]
        else:
            assert events[-1] == "[DONE]"
            assert events[-2]["choices"][0]["finish_reason"] == ("length" if drain else "abort")
            assert code == 0, err[-2000:]
            assert "stopped after" in err and "failed" not in err and "exited with code" not in err, err[-2000:]
        left_behind = "aborting the torch.distributed process groups did not finish within 3 s; leaving it behind"
        assert (left_behind in err) == (how == "stuck-teardown"), err[-2000:]
        assert "did not finish" not in err.replace(left_behind, ""), err[-2000:]  # no other wait ran out
        assert _gone(ranks[0]), f"rank 1 (pid {ranks[0]}) outlived the server"
        return proc.pid, ranks[0]
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="finds the rank process through /proc")
@pytest.mark.parametrize("how", SERVER_ENDINGS)
def test_tensor_parallel_server_exits_promptly_however_it_ends(how):
    pytest.importorskip("aiohttp")  # the server's packages
    pytest.importorskip("msgspec")
    serve_and_end(how, "--device", "cpu")


def test_four_ranks_equal_one_process(tiny_llm):
    """TP=4 on the preset: one attention head per rank, each expert's intermediate dimension cut in four."""
    prompts = [[3 + 5 * i for i in range(40)], [7 + 3 * i for i in range(70)]]
    with LLM(tensor_parallel_size=4, **COMMON) as llm:
        assert llm.engine.runner.model.model.layers[0].self_attn.num_heads == 1
        assert generate(llm, prompts) == generate(tiny_llm, prompts)


def test_a_rank_that_fails_to_start_is_named(monkeypatch, tmp_path):
    """The child exits before joining the group (here: a stand-in interpreter that exits 3): rank 0 names it
    at once instead of waiting for the rendezvous timeout, and no process group is left behind."""
    import torch.distributed as dist

    failing = tmp_path / "python"
    failing.write_text("#!/bin/sh\nexit 3\n")
    failing.chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(failing))
    with pytest.raises(RankFailedError, match=r"rank 1 \(pid \d+\) exited with code 3 while starting"):
        LLM(tensor_parallel_size=2, **COMMON)
    assert not dist.is_initialized()


def test_model_shapes_that_do_not_split_are_refused():
    from minidsa.config import resolve_model

    model = resolve_model(None)[0]  # the tiny preset: 4 heads
    with pytest.raises(ConfigError, match="tensor_parallel_size.*3 does not divide the model's num_attention_heads"):
        EngineConfig(tensor_parallel_size=3).validate_parallel(model)
    with pytest.raises(ConfigError, match="distributed_executor_backend"):
        EngineConfig(tensor_parallel_size=2, distributed_executor_backend="uni").validate()


@pytest.mark.skipif(not triton_usable(torch.device("cpu"))[0], reason="needs Triton's interpreter on CPU")
def test_single_rank_group_compiles_its_collectives_into_the_layer_graphs():
    """tensor_parallel_size 1 through the distributed path (a process group of one, in this process): the
    compiled decoder layers trace the all-reduces (no graph break with fullgraph=True), and the tokens are
    the plain engine's."""
    from test_compile import RecordingBackend

    kw = dict(COMMON, kernel_backend="triton", cuda_graph_max_bs=1, max_running_requests=1)
    plain = LLM(**kw)
    prompts = [[3 + i for i in range(24)]]
    params = SamplingParams(max_tokens=3, ignore_eos=True, detokenize=False)
    reference = generate(plain, prompts, params)
    backend = RecordingBackend()
    with LLM(distributed_executor_backend="mp", **kw) as one:
        runner = one.engine.runner
        assert runner.ranks.world_size == 1 and runner.model.tp.collectives
        static_fast_paths(runner, None, backend)
        replays = count_replays(runner.graphs)
        assert generate(one, prompts, params) == reference
        assert replays[StepKind.DECODE] > 0
    graphs = [g for g in backend.graphs if len(g.graph.nodes) > 0]
    assert graphs and all(any("all_reduce" in str(n.target) for n in g.graph.nodes) for g in graphs)


@pytest.mark.parametrize("expert_parallel", [False, True], ids=["tp", "ep"])
def test_each_rank_holds_its_slice_of_the_one_process_weights(expert_parallel):
    """Built for rank r of 2 (no processes needed), every parameter is rank r's slice of the one-process
    model's: column-parallel rows, row-parallel columns, vocab rows, experts' intermediate slices or whole
    experts; replicated ones equal."""
    from minidsa.common.tensor_parallel import TensorParallel, building_with
    from minidsa.config import resolve_model
    from minidsa.models.loader import build_model

    cfg, _, std, _ = resolve_model(None)
    build = lambda: build_model(cfg, None, torch.float32, torch.device("cpu"), seed=0, init_std=std,  # noqa: E731
                                progress=False)
    full = dict(build().named_parameters())
    for rank in range(2):
        with building_with(TensorParallel(rank=rank, size=2, expert_parallel=expert_parallel)):
            shard = build()
        layer = shard.model.layers[1]
        experts = layer.mlp.experts
        for name, p in shard.named_parameters():
            want = full[name]
            if name.endswith("experts.gate_up_proj") and not expert_parallel:
                inter, k = want.shape[1] // 2, p.shape[1] // 2
                want = torch.cat([want[:, rank * k:(rank + 1) * k], want[:, inter + rank * k:inter + (rank + 1) * k]], 1)
            elif ".mlp.experts." in name and expert_parallel:
                want = want[experts.first_expert:experts.first_expert + experts.num_local_experts]
            elif p.shape[-1] != want.shape[-1]:  # row-parallel, experts' down_proj
                k = p.shape[-1]
                want = want[..., rank * k:(rank + 1) * k]
            elif p.shape != want.shape:  # column-parallel, vocab-parallel
                k = p.shape[-2]
                want = want[..., rank * k:(rank + 1) * k, :]
            assert torch.equal(p, want), name
        assert layer.self_attn.num_heads == cfg.num_attention_heads // 2
        assert shard.lm_head.weight.shape[0] == cfg.vocab_size // 2


TORCHRUN_SCRIPT = """
import sys
from minidsa import LLM, SamplingParams

llm = LLM(device="cpu", dtype="float32", tensor_parallel_size=2, max_total_tokens=2048, max_running_requests=4,
          progress=False)
print("returned", llm.is_driver, flush=True)
if llm.is_driver:
    out = llm.generate([[5, 6, 7, 8, 9, 10]], SamplingParams(max_tokens=4, ignore_eos=True, detokenize=False))
    print("tokens", out[0].token_ids, flush=True)
    llm.close()
else:
    llm.follow()
    print("followed", flush=True)
"""


def test_under_torchrun_every_rank_returns_from_building_its_engine(tmp_path):
    """A launcher that starts every rank (torchrun: RANK / WORLD_SIZE / MASTER_ADDR set) runs the user's script
    on each; LLM(...) returns on every rank, rank 0 runs the requests and the other ranks `follow()` until rank 0
    closes. The tokens are the one-process engine's."""
    import socket
    import subprocess
    import sys

    script = tmp_path / "script.py"
    script.write_text(TORCHRUN_SCRIPT)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    procs = []
    for rank in range(2):
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2",
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
               "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
        procs.append(subprocess.Popen([sys.executable, str(script)], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    outs = [p.communicate(timeout=600) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [o[1][-2000:] for o in outs]
    assert "returned True" in outs[0][0] and "returned False" in outs[1][0] and "followed" in outs[1][0]
    want = generate(LLM(**COMMON), [[5, 6, 7, 8, 9, 10]], SamplingParams(max_tokens=4, ignore_eos=True,
                                                                          detokenize=False))[0]
    assert f"tokens {want}" in outs[0][0]
