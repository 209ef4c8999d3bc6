"""Data-parallel attention on CPU (gloo): `--tp 2 --enable-dp-attention` produces exactly the tokens of one process.

Each rank runs attention, the indexer and its own KV cache over the requests rank 0's engine placed on it; the ranks'
rows meet in every MoE layer (routed experts whole, half per rank). Several concurrent requests of different lengths
and output lengths, so both ranks get work and one is idle in some steps (it runs a dummy token so that its MoE
collectives match). Plus: the combinations this first slice refuses, one line and exit code 2 before any rank starts,
`minidsa generate` as a user runs it, where a new request goes, and a killed rank named at once.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys

import pytest
import torch

from dp_graphs_rank import ENV as REPLAYS_ENV, FRAMES_ENV, static_graphs
from harness import experts_checkpoint, pretend_gpus_and_forbid_ranks, ranks_run
from test_speculative import force_drafts, forced_override
from tp_forced_rank import ENV as FORCED_DRAFTS_ENV, known_ids_only
from hf_tiny import save_hf_with_mtp
from minidsa import LLM, SamplingParams
from minidsa.common.request import Request
from minidsa.config import ConfigError, EngineConfig
from minidsa.attention.select import triton_usable
from minidsa.common.plan import StepKind
from minidsa.parallel.dp_attention import DPStepPlan

LOGPROBS = SamplingParams(max_tokens=4, ignore_eos=True, detokenize=False, logprobs=True, top_logprobs=2,
                          prompt_logprobs=1)
COMMON = dict(device="cpu", dtype="float32", max_total_tokens=2048, max_running_requests=4, progress=False)


def workload(vocab: int, index_topk: int) -> tuple[list[list[int]], list[SamplingParams]]:
    """Six requests: prompts shorter and longer than index_topk (sparse attention), two sharing a long prefix (each
    rank's prefix cache), and output lengths from 1 to 12, so that ranks finish at different steps."""
    rng = random.Random(5)

    def tokens(n: int) -> list[int]:
        return [rng.randint(2, vocab - 1) for _ in range(n)]

    shared = tokens(2 * index_topk)
    prompts = [tokens(index_topk + 5), shared + [5, 6, 7], tokens(3), shared + [9], tokens(2 * index_topk + 11),
               tokens(17)]
    lengths = [12, 3, 9, 1, 6, 10]
    return prompts, [SamplingParams(max_tokens=n, ignore_eos=True, detokenize=False) for n in lengths]


def record_steps(engine) -> list[DPStepPlan]:
    """Every DP step the engine launches from now on."""
    steps: list[DPStepPlan] = []
    launch = engine.worker.launch_dp

    def recording(step):
        steps.append(step)
        return launch(step)

    engine.worker.launch_dp = recording
    return steps


def count_two_batch_runs(monkeypatch) -> list[int]:
    """From now on, every forward of this process that runs its MoE layers as two micro-batches appends its token
    count (two-batch overlap, models/two_batch.py)."""
    from minidsa.models import two_batch

    runs: list[int] = []
    run_layers = two_batch.run_layers

    def counted(layers, caches, halves, *args):
        runs.append(sum(h.num_tokens for h in halves))
        return run_layers(layers, caches, halves, *args)

    monkeypatch.setattr(two_batch, "run_layers", counted)
    return runs


# Two-batch overlap splits every main-model forward of 2 tokens or more on some rank: the bucket-2 graphs (one
# request per micro-batch), and every uncaptured step's tokens in half on each rank
OVERLAP = dict(enable_two_batch_overlap=True, two_batch_overlap_min_tokens=2)


def check_splits(steps, split: list[int], graph_tokens: int, empty_half: bool) -> None:
    """Rank 0 ran two micro-batches exactly in the graph steps of bucket 2 (`graph_tokens` tokens each) and the
    uncaptured steps rank 0 split (every rank's first micro-batch half of its main-forward tokens); among those a
    prefill cut inside a request, and (`empty_half`) a rank with one token (an idle rank's dummy, one decode) whose
    first micro-batch was empty."""
    expected = []
    for s in steps:
        if s.graph is not None:
            assert s.two_batches is None
            expected += [graph_tokens] if s.graph[0] == 2 else []
            continue
        main = next(n for kind, n in s.forwards if not kind.runs_mtp)
        assert s.two_batches == (tuple(n // 2 for n in main) if max(main) >= 2 else None), (main, s.two_batches)
        expected += [main[0]] if s.two_batches is not None else []
    assert split == expected and expected
    split_steps = [s for s in steps if s.two_batches is not None]
    assert any(0 in s.two_batches for s in split_steps) == empty_half
    assert any(p is not None and p.kind == StepKind.EXTEND and p.extend_lens[0] >= 2
               for s in split_steps for p in s.plans)
def _checkpoint(arch: str, tmp_path) -> str:
    """A tiny 3-layer checkpoint of `arch` (GLM: every other layer shares its top-k)."""
    over = dict(num_hidden_layers=3)
    if arch == "glm_moe_dsa":
        over.update(index_topk_freq=2, index_skip_topk_offset=1)
    return save_hf_with_mtp(arch, str(tmp_path / arch), seed=7, **over)


@pytest.mark.parametrize("arch,overlap", [("deepseek_v32", False), ("glm_moe_dsa", False), ("deepseek_v32", True)],
                         ids=["deepseek_v32", "glm_moe_dsa", "dsv32_two_batch"])
def test_dp_attention_over_two_ranks_gives_one_process_tokens(arch, overlap, tmp_path, monkeypatch):
    """(Without graphs.) With two-batch overlap from 2 tokens every step runs its MoE layers as two micro-batches,
    each rank's tokens in half: the same tokens, logprobs and prompt logprobs."""
    path = _checkpoint(arch, tmp_path)
    with LLM(path, **COMMON) as single:
        config = single.engine.model_config
        prompts, params = workload(config.vocab_size, config.index_topk)
        reference = [o.token_ids for o in single.generate(prompts, params)]
        one_rank_kv = single.engine.metrics().kv_total_tokens
        ref_lp = single.generate(prompts[:3], LOGPROBS)

    split = count_two_batch_runs(monkeypatch)
    with LLM(path, tensor_parallel_size=2, enable_dp_attention=True, **(OVERLAP if overlap else {}), **COMMON) as dp:
        engine = dp.engine
        assert len(engine.attention_ranks) == 2 and not engine.overlap
        model = engine.runner.model
        experts = model.model.layers[1].mlp.experts
        assert experts.num_local_experts == experts.n_experts // 2  # routed experts: half per rank, whole
        assert model.model.layers[0].self_attn.num_heads == config.num_attention_heads  # attention: every head
        assert model.lm_head.weight.shape[0] == config.vocab_size  # lm_head whole (no logits all-gather)
        steps = record_steps(engine)
        assert [o.token_ids for o in dp.generate(prompts, params)] == reference
        busy = [[p is not None for p in step.plans] for step in steps]
        assert all(any(b) for b in busy)
        assert any(b[0] for b in busy) and any(b[1] for b in busy)  # both ranks served requests
        assert any(b[0] != b[1] for b in busy)  # and one rank was idle while the other ran
        # a new prompt sharing the long prefix goes to the rank whose cache holds it (and hits it there)
        holder = max(engine.attention_ranks, key=lambda r: r.cached_prefix_tokens(prompts[1]))
        assert holder.cached_prefix_tokens(prompts[1]) >= config.index_topk
        hits = engine.metrics().prefix_cache_hit_tokens_total
        rid = engine.add_request(prompts[1][:-3] + [11, 12], params[1])
        assert engine.requests[rid].attention_rank == holder.rank
        while engine.has_unfinished():
            engine.step()
        assert engine.metrics().prefix_cache_hit_tokens_total - hits >= config.index_topk
        # the second round: one request alone (the other rank idle throughout), then all again (prefix cache hits)
        assert [o.token_ids for o in dp.generate(prompts[:1], params[:1])] == reference[:1]
        assert [o.token_ids for o in dp.generate(prompts, params)] == reference
        # sampled and prompt logprobs come back from the rank that ran the request
        for got, want in zip(dp.generate(prompts[:3], LOGPROBS), ref_lp):
            assert got.token_ids == want.token_ids
            assert got.logprobs == pytest.approx(want.logprobs, abs=1e-4)
            assert got.prompt_logprobs[1:] == pytest.approx(want.prompt_logprobs[1:], abs=1e-4)
        metrics = engine.metrics()
        assert metrics.kv_total_tokens == 2 * one_rank_kv  # each rank its own KV cache
        assert metrics.prefix_cache_hit_tokens_total > 0
        engine.check_no_leaks()
    assert bool(split) == overlap
    if overlap:  # every step where some rank ran 2 tokens or more split, each rank's tokens in half
        mains = [next(n for kind, n in s.forwards if not kind.runs_mtp) for s in steps]
        assert all(s.two_batches == (tuple(n // 2 for n in m) if max(m) >= 2 else None) for s, m in zip(steps, mains))
        assert any(s.two_batches is not None and 0 in s.two_batches for s in steps)


def test_dp_attention_over_four_ranks_with_two_batch_overlap_gives_one_process_tokens(tiny_llm, monkeypatch):
    """N = 4, the x4 machine's shape, on CPU: the tiny preset's 8 routed experts 2 per rank, six requests placed over
    four attention ranks (some idle in a step, some with one token), every step of 2+ tokens on a rank split in two
    micro-batches, each exchange padded to its ranks' most: one process's greedy tokens."""
    config = tiny_llm.engine.model_config
    prompts, params = workload(config.vocab_size, config.index_topk)
    reference = [o.token_ids for o in tiny_llm.generate(prompts, params)]
    split = count_two_batch_runs(monkeypatch)
    with LLM(tensor_parallel_size=4, enable_dp_attention=True, **OVERLAP, **COMMON) as dp:
        engine = dp.engine
        assert len(engine.attention_ranks) == 4
        experts = engine.runner.model.model.layers[1].mlp.experts
        assert experts.num_local_experts * 4 == experts.n_experts
        steps = record_steps(engine)
        assert [o.token_ids for o in dp.generate(prompts, params)] == reference
        engine.check_no_leaks()
    assert split and any(s.two_batches is not None and 0 in s.two_batches for s in steps)
    assert max(sum(p is not None for p in s.plans) for s in steps) >= 3  # three or more ranks busy in one step


def _run(engine, prompts, params, prefix: str) -> dict[int, list[int]]:
    """Every prompt's tokens, by index, its request id `prefix` + index."""
    ids = {engine.add_request(p, sp, request_id=f"{prefix}{i}"): i for i, (p, sp) in enumerate(zip(prompts, params))}
    got: dict[int, list[int]] = {}
    while engine.has_unfinished():
        got.update({ids[o.request_id]: o.token_ids for o in engine.step() if o.finished})
    return got


@pytest.mark.parametrize("arch", ["deepseek_v32", "glm_moe_dsa"])
def test_dp_attention_with_mtp_speculation_gives_one_process_tokens(arch, tmp_path, monkeypatch):
    """MTP chains (3 steps: 2 draft forwards, verify, draft extend per round) under DP attention over two ranks: one
    process's greedy tokens, with the real (random) drafts and with drafts forced to the right tokens up to a random
    depth on both ranks, so long paths are accepted. Steps mix a speculating rank with a prefilling or idle one: each
    joins the other's forwards it has nothing for with a dummy token, in the order rank 0 laid out."""
    path = _checkpoint(arch, tmp_path)
    with LLM(path, **COMMON) as single:
        config = single.engine.model_config
        prompts, params = workload(config.vocab_size, config.index_topk)
        reference = _run(single.engine, prompts, params, "r")
    by_id = {f"r{i}": tokens for i, tokens in reference.items()}
    spec = tmp_path / "forced_drafts.json"  # rank 1 forces the drafts of the "r" requests as rank 0 does
    spec.write_text(json.dumps({"reference": by_id, "topk": 1, "seed": 3}))
    ranks_run(monkeypatch, tmp_path, "tp_forced_rank.py")
    monkeypatch.setenv(FORCED_DRAFTS_ENV, str(spec))
    with LLM(path, tensor_parallel_size=2, enable_dp_attention=True, speculative_num_steps=3, **COMMON) as dp:
        engine = dp.engine
        steps = record_steps(engine)
        assert _run(engine, prompts, params, "real") == reference  # ids the forcing does not know: real drafts
        force_drafts(engine.speculator, known_ids_only(by_id, forced_override(by_id, 1, random.Random(3))))
        before = engine.metrics().spec_accepted_tokens_total
        assert _run(engine, prompts, params, "r") == reference
        metrics = engine.metrics()
        assert metrics.spec_accepted_tokens_total - before >= 8  # long paths accepted, counted over both ranks
        # a request arrives while both ranks speculate: its rank prefills beside the other's round
        got: dict[str, list[int]] = {}
        ids = {engine.add_request(prompts[i], params[i], request_id=f"late{i}"): i for i in (0, 2)}
        for _ in range(2):
            got.update({o.request_id: o.token_ids for o in engine.step() if o.finished})
        ids[engine.add_request(prompts[5], params[5], request_id="late5")] = 5
        while engine.has_unfinished():
            got.update({o.request_id: o.token_ids for o in engine.step() if o.finished})
        assert {ids[r]: t for r, t in got.items()} == {i: reference[i] for i in (0, 2, 5)}
        engine.check_no_leaks()
    kinds = [tuple(None if p is None else p.kind for p in step.plans) for step in steps]
    assert (StepKind.SPEC, StepKind.EXTEND) in kinds or (StepKind.EXTEND, StepKind.SPEC) in kinds
    assert (StepKind.SPEC, None) in kinds or (None, StepKind.SPEC) in kinds
    for step, busy in zip(steps, kinds):  # a round's layout: 2 draft forwards, verify, draft extend
        if StepKind.SPEC in busy:
            main = StepKind.EXTEND if StepKind.EXTEND in busy else StepKind.VERIFY  # a prefill beside: mixed
            assert [kind for kind, _ in step.forwards] == [StepKind.DRAFT] * 2 + [main, StepKind.DRAFT_EXTEND]


@pytest.mark.parametrize("spec_steps", [0, 3], ids=["plain", "mtp"])
def test_structured_outputs_under_dp_attention_give_one_process_answers(spec_steps):
    """Rank 0 makes each rank's grammar masks with its plan (no overlap: every earlier token is in the grammars) and
    they travel with the step: JSON-schema answers, greedy and sampled, beside unconstrained requests, placed on both
    ranks, are one process's token for token and follow their schemas; with MTP chains too (a constrained row
    samples its token from the verify's first position under its mask, on its own rank)."""
    from test_structured_outputs import _check_answer, _requests

    reqs = _requests()[:6] + [([5, 17, 902], SamplingParams(max_tokens=12, temperature=1.0, seed=3)),
                              ([9, 8, 7, 6], SamplingParams(max_tokens=12, ignore_eos=True))]
    prompts, params = [p for p, _ in reqs], [sp for _, sp in reqs]
    args = dict(device="cpu", dtype="float32", progress=False, max_running_requests=4,
                speculative_num_steps=spec_steps)
    with LLM(**args) as single:
        want = single.generate(prompts, params)
    with LLM(tensor_parallel_size=2, enable_dp_attention=True, **args) as dp:
        steps = record_steps(dp.engine)
        got = dp.generate(prompts, params)
        dp.engine.check_no_leaks()
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    for (_, sp), out in zip(reqs[:6], got):
        _check_answer(out, sp.response_format["json_schema"]["schema"])
    masked = [[p is not None and bool(p.grammar_rows) for p in s.plans] for s in steps]
    assert [True, True] in masked  # both ranks sampled constrained rows in one step, each with its own masks


ARCH_AND_OVERLAP = [("deepseek_v32", False), ("glm_moe_dsa", False), ("glm_moe_dsa", True)]


@pytest.mark.parametrize("arch,overlap", ARCH_AND_OVERLAP, ids=["deepseek_v32", "glm_moe_dsa", "glm_two_batch"])
def test_dp_attention_decode_graphs_replay_in_lockstep_and_give_one_process_tokens(arch, overlap, tmp_path,
                                                                                     monkeypatch):
    """Through the CUDA graphs' static, padded buffers (run eagerly on CPU, as `static_fast_paths` does) and a
    compiled engine's step functions (the layer uncompiled; start-up's warm-up of the uncaptured path included) on
    both ranks (`dp_graphs_rank.static_graphs`): a step whose busy ranks all decode replays the DECODE graph of one
    bucket on every rank (the smallest that holds the largest rank's batch; an idle rank replays it with padding
    rows only), any other step (a rank prefills)
    runs every rank uncaptured; the tokens are one process's. Each rank logs the graphs it replays: the same
    keys, in the same order, as rank 0 chose in the steps. With two-batch overlap (GLM: layers reusing the
    previous layer's top-k, each micro-batch its own) every bucket-2 replay runs as two micro-batches on both
    ranks (their exchanges must match), and so does every uncaptured step, each rank's tokens in half (a prompt
    cut inside, an idle rank's first micro-batch empty), with the same tokens."""
    path = _checkpoint(arch, tmp_path)
    with LLM(path, **COMMON) as single:
        config = single.engine.model_config
        prompts, params = workload(config.vocab_size, config.index_topk)
        reference = [o.token_ids for o in single.generate(prompts, params)]

    log = tmp_path / "rank1_replays.jsonl"
    rank0: list[list] = []
    static_graphs(monkeypatch.setattr, lambda key: rank0.append([key[0].name, key[1], key[2]]))
    ranks_run(monkeypatch, tmp_path, "dp_graphs_rank.py")
    monkeypatch.setenv(REPLAYS_ENV, str(log))
    split = count_two_batch_runs(monkeypatch)
    with LLM(path, tensor_parallel_size=2, enable_dp_attention=True, cuda_graph_max_bs=2,
             **(OVERLAP if overlap else {}), **COMMON) as dp:
        engine = dp.engine
        graphs = engine.runner.graphs
        assert graphs is not None and graphs.buckets == [1, 2] and list(graphs.shapes) == [StepKind.DECODE]
        steps = record_steps(engine)
        assert [o.token_ids for o in dp.generate(prompts, params)] == reference
        assert [o.token_ids for o in dp.generate(prompts[:1], params[:1])] == reference[:1]  # rank 1 idle
        # a request arrives while both ranks decode: its rank prefills beside the other's decode step
        got: dict[str, list[int]] = {}
        ids = {engine.add_request(prompts[i], params[i]): i for i in (0, 2)}
        for _ in range(3):
            got.update({o.request_id: o.token_ids for o in engine.step()})
        ids[engine.add_request(prompts[5], params[5])] = 5
        while engine.has_unfinished():
            got.update({o.request_id: o.token_ids for o in engine.step()})
        assert {ids[r]: t for r, t in got.items()} == {i: reference[i] for i in (0, 2, 5)}
        engine.check_no_leaks()
    rank1 = [json.loads(line) for line in log.read_text().splitlines()]
    chosen = [["DECODE", *s.graph] for s in steps if s.graph is not None]
    assert rank0 == rank1 == chosen  # both ranks replayed the graph rank 0 chose, every graph step, in lockstep
    if overlap:  # (nothing runs at a capture on CPU)
        check_splits(steps, split, 2, empty_half=True)
    else:
        assert not split and all(s.two_batches is None for s in steps)

    def kinds(step):
        return [None if p is None else p.kind for p in step.plans]

    def sizes(step):
        return [0 if p is None else p.batch_size for p in step.plans]

    for s in steps:
        decoding = all(k in (None, StepKind.DECODE) for k in kinds(s))
        assert (s.graph is not None) == (decoding and max(sizes(s)) <= 2), (kinds(s), sizes(s), s.graph)
        if s.graph is not None:
            assert s.graph[0] == (1 if max(sizes(s)) == 1 else 2)
    graphed = [s for s in steps if s.graph is not None]
    assert any(all(sizes(s)) and sizes(s)[0] != sizes(s)[1] for s in graphed)  # both decode, different batches
    assert any(0 in sizes(s) for s in graphed)  # one rank idle, replaying padding rows only
    assert any(set(kinds(s)) == {StepKind.EXTEND, StepKind.DECODE} for s in steps)  # one prefills: uncaptured
    assert any(s.graph is None and set(kinds(s)) == {StepKind.DECODE} for s in steps)  # past the largest bucket


@pytest.mark.parametrize("arch,overlap", ARCH_AND_OVERLAP, ids=["deepseek_v32", "glm_moe_dsa", "glm_two_batch"])
def test_dp_attention_speculative_rounds_replay_graphs_in_lockstep(arch, overlap, tmp_path, monkeypatch):
    """MTP chains through the graphs' static, padded buffers on both ranks (as the test above): a step whose busy
    ranks all run a speculative round replays each of its forwards' graphs (DRAFT twice, VERIFY, DRAFT_EXTEND) at the
    one pair of buckets rank 0 chose, on every rank (an idle rank with padding rows only); a step where a rank prefills
    runs uncaptured. The tokens are one process's; both ranks replay the same keys, in the order rank 0 laid out.
    With two-batch overlap every bucket-2 VERIFY runs as two micro-batches of one request's 4 tokens each, and every
    uncaptured main forward (a prefill beside a round) as each rank's tokens in half (the MTP layer's forwards run
    whole)."""
    path = _checkpoint(arch, tmp_path)
    with LLM(path, **COMMON) as single:
        config = single.engine.model_config
        prompts, params = workload(config.vocab_size, config.index_topk)
        reference = _run(single.engine, prompts, params, "r")

    log = tmp_path / "rank1_replays.jsonl"
    rank0: list[list] = []
    static_graphs(monkeypatch.setattr, lambda key: rank0.append([key[0].name, key[1], key[2]]))
    ranks_run(monkeypatch, tmp_path, "dp_graphs_rank.py")
    monkeypatch.setenv(REPLAYS_ENV, str(log))
    split = count_two_batch_runs(monkeypatch)
    with LLM(path, tensor_parallel_size=2, enable_dp_attention=True, speculative_num_steps=3, cuda_graph_max_bs=2,
             **(OVERLAP if overlap else {}), **COMMON) as dp:
        engine = dp.engine
        assert set(engine.runner.graphs.shapes) == {StepKind.DRAFT, StepKind.VERIFY, StepKind.DRAFT_EXTEND}
        steps = record_steps(engine)
        assert _run(engine, prompts, params, "r") == reference
        assert _run(engine, prompts[:1], params[:1], "alone") == {0: reference[0]}  # rank 1 idle throughout
        engine.check_no_leaks()
    rank1 = [json.loads(line) for line in log.read_text().splitlines()]
    chosen = [[kind.name, *s.graph] for s in steps if s.graph is not None for kind, _ in s.forwards]
    assert rank0 == rank1 == chosen
    if overlap:
        check_splits(steps, split, 8, empty_half=False)
    else:
        assert not split and all(s.two_batches is None for s in steps)
    graphed = [[p is not None for p in s.plans] for s in steps if s.graph is not None]
    assert [True, True] in graphed and ([True, False] in graphed or [False, True] in graphed)
    for s in steps:
        kinds = {p.kind for p in s.plans if p is not None}
        fits = max(p.batch_size for p in s.plans if p is not None) <= 2
        assert (s.graph is not None) == (kinds == {StepKind.SPEC} and fits), (kinds, s.graph)


COMPILED_ENGINE_ARGS = dict(model=None, device="cpu", dtype="float32", max_total_tokens=1024, max_running_requests=4,
                            cuda_graph_max_bs=2, progress=False, kernel_backend="triton", chunked_prefill_size=8,
                            max_prefill_tokens=12)
COMPILED_PARAMS = SamplingParams(max_tokens=4, ignore_eos=True, detokenize=False)


@pytest.fixture(scope="module")
def compiled_waves() -> tuple[list, list]:
    """Two waves of prompts for the compiled DP engine test, and one plain process's greedy tokens for them (MTP is
    lossless: both variants of the test expect these)."""
    rng = random.Random(7)
    with LLM(**COMPILED_ENGINE_ARGS) as single:
        vocab = single.engine.model_config.vocab_size
        waves = [[[rng.randint(2, vocab - 1) for _ in range(n)] for n in (9, 34, 11, 2, 5, 20)],
                 [[rng.randint(2, vocab - 1) for _ in range(n)] for n in (3,)]]
        return waves, [[o.token_ids for o in single.generate(wave, COMPILED_PARAMS)] for wave in waves]


@pytest.mark.skipif(not triton_usable(torch.device("cpu"))[0], reason="needs Triton's interpreter on CPU")
@pytest.mark.parametrize("spec_steps", [0, 3], ids=["plain", "mtp"])
def test_compiled_dp_attention_engine_compiles_nothing_after_start_up(spec_steps, tmp_path, monkeypatch,
                                                                      compiled_waves):
    """Both ranks compile their decoder layers (aot_eager, counted) and warm them up at start-up, as on a GPU; then
    steps of every mix (both ranks decoding different batches through the graphs' buffers, one idle, one prefilling
    chunks beside the other's decode, batches past the largest bucket) compile nothing more on either rank, and the
    tokens are the plain one-process engine's. With MTP chains, the same for speculative rounds (draft, verify and
    draft-extend forwards, a prefill's MTP catch-up beside another rank's round, dummy forwards of both layers).
    Plain, with two-batch overlap on the longer steps: its compiled stages too compile nothing after start-up."""
    from torch._dynamo.testing import CompileCounterWithBackend

    engine_args, params = COMPILED_ENGINE_ARGS, COMPILED_PARAMS
    waves, want = compiled_waves
    counter = CompileCounterWithBackend("aot_eager")
    frames = tmp_path / "rank1_frames.txt"
    static_graphs(monkeypatch.setattr, lambda key: None, counter)
    ranks_run(monkeypatch, tmp_path, "dp_graphs_rank.py")
    monkeypatch.setenv(REPLAYS_ENV, str(tmp_path / "rank1_replays.jsonl"))
    monkeypatch.setenv(FRAMES_ENV, str(frames))
    # plain: with two-batch overlap from 8 tokens (the 8-token prefill chunks split, shorter steps and the decode
    # graphs run whole): its compiled stages are warmed up at start-up too
    overlap = {} if spec_steps else dict(enable_two_batch_overlap=True, two_batch_overlap_min_tokens=8)
    with LLM(tensor_parallel_size=2, enable_dp_attention=True, speculative_num_steps=spec_steps,
             **overlap, **engine_args) as dp:
        assert dp.engine.runner.compiled and (dp.engine.runner.overlap is not None) == bool(overlap)
        at_start_up = counter.frame_count
        assert at_start_up > 0
        steps = record_steps(dp.engine)
        assert [[o.token_ids for o in dp.generate(wave, params)] for wave in waves] == want
        assert counter.frame_count == at_start_up, "rank 0 compiled again while serving"
    rank1 = [int(line) for line in frames.read_text().split()]
    assert rank1[0] > 0 and rank1[-1] == rank1[0], "rank 1 compiled again while serving"
    kinds = [{p.kind for p in s.plans if p is not None} for s in steps]
    decode = StepKind.SPEC if spec_steps else StepKind.DECODE
    assert any(s.graph is not None for s in steps) and any(s.graph is None for s in steps)
    assert any(k == {StepKind.EXTEND, decode} for k in kinds)
    assert any(None in s.plans for s in steps)
    assert any(s.graph is None and k == {decode} for s, k in zip(steps, kinds))  # past the largest bucket
    split = [s.two_batches is not None for s in steps]
    assert (any(split) and not all(split)) if overlap else not any(split)


def test_compiled_moe_exchange_does_not_compile_again_for_new_row_counts():
    """torch.compile of the MoE layer under DP attention (a group of one, in this process; dynamic sizes as the
    engine's compiled layer): steps whose ranks run different row counts (this rank padding to the step's most,
    by nothing when it has the most) compile one graph beside the one for equal counts (the DECODE graphs and the
    warm-up), not one per mix of counts; the outputs are the uncompiled layer's."""
    import dataclasses

    from torch._dynamo.testing import CompileCounterWithBackend

    from minidsa.common.batch import ForwardBatch
    from two_batch_check import experts_in_group

    from minidsa.exec.runner import layer_tracing
    from minidsa.parallel.launch import single_rank_group

    group = single_rank_group("cpu", expert_parallel=True)
    try:
        moe = experts_in_group(group.tp, 1, "cpu")[0]
        hidden = moe.gate.weight.shape[1]
        counter = CompileCounterWithBackend("aot_eager")
        compiled = torch.compile(lambda x, b: moe(x, None, b), dynamic=True, fullgraph=True, backend=counter)
        # (this rank's rows, the step's most): a one-rank group stands for a rank of a larger step
        for rows, most in [(3, 3), (2, 5), (4, 4), (1, 6), (6, 6), (6, 9), (2, 2), (1, 1), (5, 8), (7, 7)]:
            batch = ForwardBatch.build(StepKind.EXTEND, list(range(rows)), [0], [0], [rows],
                                       torch.zeros(rows, dtype=torch.int64), "cpu").for_dp_attention((rows,))
            if (rows, most) in ((6, 6), (7, 7)):  # the rank with the most rows of a step whose counts differ
                batch = dataclasses.replace(batch, dp_pad=torch.empty(0, dtype=torch.int64),
                                            dp_real_rows=torch.arange(rows))
            elif most != rows:
                batch = dataclasses.replace(batch, dp_pad=torch.empty(most - rows, dtype=torch.int64),
                                            dp_real_rows=torch.arange(rows))
            x = torch.randn(rows, hidden)
            with torch.no_grad(), layer_tracing():
                torch.testing.assert_close(compiled(x, batch), moe(x, None, batch), atol=1e-5, rtol=1e-5)
        assert counter.frame_count == 2
    finally:
        group.shutdown()
    assert not torch.distributed.is_initialized()


def test_micro_batches_cut_a_request_and_carry_their_own_exchange_layout():
    """An uncaptured DP forward of three requests (3, 4 and 2 tokens after prefixes of 0, 5 and 2) split after 5
    tokens: the second request is cut (2 tokens in the first micro-batch, 2 in the second), each half's request
    rows, lengths and token -> request index are its own, and each half's exchange pads to the ranks' most in it
    (this rank 5 of (5, 2), then 4 of (4, 1))."""
    from minidsa.common.batch import ForwardBatch

    batch = ForwardBatch.build(StepKind.EXTEND, list(range(9)), [7, 8, 9], [0, 5, 2], [3, 4, 2],
                               torch.arange(100, 109), "cpu")
    batch = batch.for_dp_attention((9, 3), two_batches=(5, 1), rank=0)
    first, second = batch.micro_batches()
    assert first.input_ids.tolist() == [0, 1, 2, 3, 4] and second.out_cache_loc.tolist() == [105, 106, 107, 108]
    assert first.req_pool_indices.tolist() == [7, 8] and second.req_pool_indices.tolist() == [8, 9]
    assert first.extend_lens.tolist() == [3, 2] and second.extend_lens.tolist() == [2, 2]
    assert first.seq_lens.tolist() == [3, 7] and second.seq_lens.tolist() == [9, 4]
    assert first.token_req.tolist() == [0, 0, 0, 1, 1] and second.token_req.tolist() == [0, 0, 1, 1]
    assert second.positions.tolist() == [7, 8, 2, 3] and second.kv_lens.tolist() == [8, 9, 3, 4]
    assert batch.seq_lens.tolist() == [3, 9, 4] and batch.extend_lens.tolist() == [3, 4, 2]  # the whole untouched
    assert (first.dp_tokens, second.dp_tokens) == ((5, 1), (4, 2))
    assert first.dp_pad.numel() == 0 and first.dp_real_rows.tolist() == [0, 1, 2, 3, 4, 5]
    assert second.dp_pad.numel() == 0 and second.dp_real_rows.tolist() == [0, 1, 2, 3, 4, 5]
    assert first.two_batches is None and second.dp_two_batches is None
    idle = ForwardBatch.build(StepKind.EXTEND, [0], [0], [0], [1], torch.zeros(1, dtype=torch.int64), "cpu")
    empty, whole = idle.for_dp_attention((1, 9), two_batches=(0, 4), rank=0).micro_batches()
    assert empty.num_tokens == 0 and empty.batch_size == 0 and empty.dp_pad.numel() == 4
    assert whole.token_req.tolist() == [0] and whole.dp_pad.numel() == 4


@pytest.mark.skipif(not triton_usable(torch.device("cpu"))[0], reason="needs Triton's interpreter on CPU")
def test_two_batch_overlap_stages_compile_whole_once_for_every_batch():
    """Two-batch overlap's compiled stages (`ModelRunner.compile_overlap`: a MoE layer up to its exchange with the
    shared experts, and the routed experts over the gathered rows, with and without padding rows among them) trace
    without a graph break, as the engine compiles them (dynamic sizes, `layer_tracing`), once for every micro-batch
    size, and give the plain stages' outputs. Start-up's warm-up (`ModelRunner.warm_up_overlap`) traces every graph
    they need: nothing compiles after it. In one process, on a tiny engine's first MoE layer, its kernels Triton's
    (opaque ops, as on a GPU)."""
    from torch._dynamo.testing import CompileCounterWithBackend

    from minidsa.exec.runner import layer_tracing
    from minidsa.models.two_batch import call_attend, call_routed

    with LLM(**COMMON, kernel_backend="triton") as llm:
        runner = llm.engine.runner
        model = runner.model
        i = next(i for i, layer in enumerate(model.main_layers) if not hasattr(layer.mlp, "gate_proj"))
        layer, caches = model.main_layers[i], runner.attn.layer_caches[i]
        counter = CompileCounterWithBackend("aot_eager")
        stages = runner.overlap = runner.compile_overlap(counter)
        runner.warm_up_overlap([([1, 1, 1], 3), ([4, 5], 8)])  # what start-up does, on two of its shapes
        first = counter.frame_count
        assert first > 0
        hidden = model.config.hidden_size
        for rows in (2, 3, 1, 5):
            batch = runner._scratch_extend_batch([1] * rows, 1)  # the dummy slot: no request's cache
            ctx = model.layer_context(batch, runner.attn)
            h, pending = torch.randn(rows, hidden), torch.randn(rows, hidden)
            topk = torch.zeros(rows, model.config.index_topk, dtype=torch.int32)  # the dense layers' before it
            with torch.no_grad(), layer_tracing():
                got, want = stages.attend(layer, h, pending, ctx, topk, caches), call_attend(
                    layer, h, pending, ctx, topk, caches)
                for g, w in zip(got, want):
                    torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)
                gathered = torch.randn(2 * rows + 1, hidden)  # a padding row: the real ones are the others
                for real in (None, torch.tensor([i for i in range(2 * rows + 1) if i != rows])):
                    torch.testing.assert_close(stages.routed(layer.mlp, gathered, real),
                                               call_routed(layer.mlp, gathered, real), atol=1e-5, rtol=1e-5)
            assert counter.frame_count == first, "a stage compiled after the warm-up"


def test_two_batch_layer_loop_gives_each_micro_batch_its_own_layers_output():
    """`two_batch.run_layers` over three MoE layers (real experts, a stand-in attention stage) in a gloo group of
    one: the two micro-batches' exchanges interleaved give exactly what each micro-batch gets through the MoE
    layer's own exchange alone; the top-k travels with its micro-batch."""
    from two_batch_check import experts_in_group, inputs, overlapped, reference

    from minidsa.parallel.launch import single_rank_group

    group = single_rank_group("cpu", expert_parallel=True)
    try:
        moes = experts_in_group(group.tp, 3, "cpu")
        for rows, split in ((5, 2), (2, 1), (8, 4)):
            h, pending, topk = inputs(rows, moes[0].gate.weight.shape[1], "cpu", rows)
            with torch.no_grad():
                for got, want in zip(overlapped(moes, h, pending, topk, split), reference(moes, h, pending, topk,
                                                                                           split)):
                    torch.testing.assert_close(got, want, atol=0, rtol=0)
    finally:
        group.shutdown()


BAD_DP = {  # bad input -> (arguments, what the one line says)
    "no-tp": (["--device", "cpu"], "needs --tp N with N >= 2"),
    "tp-1": (["--tp", "1", "--device", "cpu"], "needs --tp N with N >= 2"),
    "experts": (["--tp", "2", "--device", "cpu"], "--tp 2 does not divide the model's n_routed_experts (5)"),
    "tree-drafts": (["--tp", "2", "--device", "cpu", "--speculative-num-steps", "2", "--speculative-topk", "2",
                     "--speculative-num-draft-tokens", "4", "--page-size", "1"], "chains only"),
    # two-batch overlap (the flag is given without --enable-dp-attention in these: see the test)
    "overlap-alone": (["--enable-two-batch-overlap"], "'enable_two_batch_overlap': needs --enable-dp-attention"),
    "overlap-min": (["--enable-dp-attention", "--tp", "2", "--enable-two-batch-overlap",
                     "--two-batch-overlap-min-tokens", "1"], "'two_batch_overlap_min_tokens': must be an integer >= 2"),
}


@pytest.mark.parametrize("bad", list(BAD_DP))
def test_unsupported_dp_attention_input_is_one_line_and_exit_2_before_any_rank_starts(bad, monkeypatch, tmp_path,
                                                                                      capsys):
    from minidsa import cli

    pretend_gpus_and_forbid_ranks(monkeypatch, 2)  # two GPUs visible, as far as minidsa can tell
    args, says = BAD_DP[bad]
    model = ["--model", experts_checkpoint(tmp_path / "ckpt")] if bad == "experts" else []
    dp = [] if "--enable-two-batch-overlap" in args else ["--enable-dp-attention"]
    assert cli.main(["generate", *model, *dp, *args]) == 2
    err = capsys.readouterr().err
    field = "" if says.startswith("'") else "'enable_dp_attention': "
    assert err.count("\n") == 1 and err.startswith(f"minidsa generate: error: config field {field}"), err
    assert says in err, err


def test_dp_attention_config_checks_without_a_model_file():
    from minidsa.config import resolve_model

    model = resolve_model(None)[0]  # the tiny preset: 8 routed experts, 4 heads
    EngineConfig(tensor_parallel_size=2, enable_dp_attention=True).validate_parallel(model)
    # heads do not need to split under DP attention (each rank holds them all); the experts do
    with pytest.raises(ConfigError, match="--tp 3 does not divide the model's n_routed_experts"):
        EngineConfig(tensor_parallel_size=3, enable_dp_attention=True).validate_parallel(model)
    with pytest.raises(ConfigError, match="uni"):
        EngineConfig(tensor_parallel_size=2, enable_dp_attention=True,
                     distributed_executor_backend="uni").validate_parallel(model)


def test_dp_attention_on_gpus_keeps_cuda_graphs_and_compile(monkeypatch):
    """Two GPUs (as far as minidsa can tell): resolve keeps CUDA graphs and torch.compile on under DP attention (no
    start-up refusal any more) and turns only overlap scheduling off."""
    from minidsa.config import resolve

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    args = resolve(EngineConfig(device="cuda", tensor_parallel_size=2, enable_dp_attention=True)).args
    assert args.enable_cuda_graph and args.enable_compile and not args.overlap_schedule


def test_generate_with_dp_attention_from_the_command_line():
    """As a user runs it: `minidsa generate --tp 2 --enable-dp-attention` on CPU, then a bad line in a fresh process
    (nothing on stderr but the one line, exit code 2)."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "minidsa", "generate", "--tp", "2", "--enable-dp-attention",
                           "--device", "cpu", "--dtype", "float32", "--max-tokens", "6", "--prompt", "Hello"],
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip(), proc.stderr[-3000:]
    proc = subprocess.run([sys.executable, "-m", "minidsa", "generate", "--enable-dp-attention", "--device", "cpu"],
                          capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert len(proc.stderr.splitlines()) == 1 and "config field 'enable_dp_attention'" in proc.stderr, proc.stderr


def test_a_new_request_goes_to_the_rank_with_the_fewest_requests_then_the_most_free_kv():
    from minidsa.engine.attention_ranks import AttentionRank, place
    from minidsa.sched.pages import KVCapacity

    def rank(r: int) -> AttentionRank:
        return AttentionRank.build(r, KVCapacity(num_pages=65, page_size=1, num_rows=4), True, 0,
                                   max_running_requests=4, max_prefill_tokens=64, chunked_prefill_size=64)

    ranks = [rank(0), rank(1)]
    assert place(ranks) is ranks[0]  # a tie: the lowest rank
    ranks[0].page_allocator.alloc(10)  # rank 0 holds KV: rank 1 has more free
    assert place(ranks) is ranks[1]
    for _ in range(2):
        ranks[1].scheduler.add(Request(request_id="x", prompt_ids=[1, 2], params=SamplingParams()))
    assert place(ranks) is ranks[0]  # fewer requests before more free pages


def test_a_request_goes_where_its_prefix_is_cached_unless_that_rank_is_too_busy():
    """Cache-aware placement: a prompt whose prefix rank 1 caches goes to rank 1, though rank 0 has fewer requests,
    while rank 1 runs at most `load_gap` more; past that, the least loaded rank. Nothing cached: the least loaded."""
    from minidsa.engine.attention_ranks import AttentionRank, place
    from minidsa.sched.pages import KVCapacity

    def rank(r: int) -> AttentionRank:
        return AttentionRank.build(r, KVCapacity(num_pages=65, page_size=4, num_rows=8), True, 0,
                                   max_running_requests=8, max_prefill_tokens=64, chunked_prefill_size=64)

    ranks = [rank(0), rank(1)]
    system = list(range(10, 22))  # three pages
    cache = ranks[1].prefix_cache
    cache.insert(None, system, ranks[1].page_allocator.alloc(3))
    prompt = system + [7, 8, 9]
    assert ranks[1].cached_prefix_tokens(prompt) == 12 and ranks[0].cached_prefix_tokens(prompt) == 0
    ranks[1].scheduler.add(Request(request_id="a", prompt_ids=[1, 2], params=SamplingParams()))
    assert place(ranks, prompt, load_gap=2) is ranks[1]  # cached there: one request more is fine
    assert place(ranks, [5] * 15, load_gap=2) is ranks[0]  # nothing cached: the least loaded
    for i in range(2):
        ranks[1].scheduler.add(Request(request_id=f"b{i}", prompt_ids=[1, 2], params=SamplingParams()))
    assert place(ranks, prompt, load_gap=2) is ranks[0]  # three more than rank 0: balance first
    assert place(ranks, prompt, load_gap=3) is ranks[1]


def test_a_killed_rank_ends_a_dp_attention_run_with_its_name(tiny_llm):
    """Also: a rank's result longer than the result channel's first message (prompt logprobs of a long prompt)
    reaches rank 0 whole, its rest sent point to point; the answers are one process's."""
    import pickle
    import signal
    import time

    from minidsa.parallel.channel import FIRST_MESSAGE_BYTES
    from minidsa.parallel.launch import RankFailedError

    llm = LLM(tensor_parallel_size=2, enable_dp_attention=True, **COMMON)
    try:
        params = SamplingParams(max_tokens=3, ignore_eos=True, detokenize=False)
        assert len(llm.generate([[5, 6, 7], [8, 9]], params)) == 2
        long = SamplingParams(max_tokens=2, ignore_eos=True, detokenize=False, prompt_logprobs=2)
        prompts = [[5, 6, 7], [(7 * i) % 900 + 2 for i in range(600)]]  # the long one on rank 1 (rank 0 busier)
        sizes: list[list[int]] = []
        channel = llm.engine.worker.results
        gather = channel.gather

        def measured(own):
            got = gather(own)
            sizes.append([len(pickle.dumps(r)) for r in got])
            return got

        channel.gather = measured
        got = llm.generate(prompts, long)
        want = tiny_llm.generate(prompts, long)
        assert [o.token_ids for o in got] == [o.token_ids for o in want]
        for a, b in zip(got, want):
            assert a.prompt_logprobs[1:] == pytest.approx(b.prompt_logprobs[1:], abs=1e-4)
        assert max(size[1] for size in sizes) > FIRST_MESSAGE_BYTES
        del channel.gather
        child = llm.engine.worker.ranks.processes.procs[1]
        os.kill(child.pid, signal.SIGKILL)
        child.wait(30)
        started = time.monotonic()
        with pytest.raises(RankFailedError, match="rank 1 .*killed by signal 9"):
            llm.generate([[5, 6, 7], [8, 9]], SamplingParams(max_tokens=50, ignore_eos=True, detokenize=False))
        assert time.monotonic() - started < 5  # named at once, not after a collective's timeout
    finally:
        llm.close()
    assert not torch.distributed.is_initialized()
    for rid in list(llm.engine.requests):  # the failed run's requests: nothing can serve them any more
        llm.engine.abort(rid, report=False)
