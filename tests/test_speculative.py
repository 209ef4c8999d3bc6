"""MTP speculative decoding through the engine: lossless, every accepted length, exact compaction.

Random MTP weights rarely agree with the target, so tests that need long
accepted paths force the drafts (`force_drafts`, a test-side wrapper of
`MTPSpeculator.propose`): it replaces draft proposals with the
target's known greedy continuation (from a run without speculation), up to a
randomly chosen depth per round, and with a wrong token after it. Replaced
proposals rank first in the tree, and on trees they are placed on a
non-first branch, so accepted paths leave the front and compaction runs.
"""

from __future__ import annotations

import random

import pytest
import torch

from harness import PagedDriver, count_replays, static_fast_paths
from hf_tiny import build_hf, save_hf, save_hf_with_mtp
from minidsa import LLM, SamplingParams
from minidsa.config import ConfigError, ModelConfig
from minidsa.common.plan import StepKind
from minidsa.speculative.mtp import MTPSpeculator
from minidsa.speculative.runner_api import SpecRunner

GREEDY = SamplingParams(max_tokens=20, ignore_eos=True, detokenize=False)
SPEC_CONFIGS = {
    "chain1": dict(speculative_num_steps=1),
    "chain2": dict(speculative_num_steps=2),
    "chain4": dict(speculative_num_steps=4),
    "tree": dict(speculative_num_steps=3, speculative_topk=2, speculative_num_draft_tokens=6, page_size=1),
}


def glm_checkpoint_with_mtp(path: str) -> str:
    """A tiny GlmMoeDsa checkpoint (shared top-k layers) plus random nextn-layer weights."""
    return save_hf_with_mtp("glm_moe_dsa", path, seed=5, num_hidden_layers=3, index_topk_freq=2,
                            index_skip_topk_offset=1)


@pytest.fixture(scope="module")
def glm_path(tmp_path_factory):
    return glm_checkpoint_with_mtp(str(tmp_path_factory.mktemp("glm_mtp")))


def prompts_for(config: ModelConfig, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    k = config.index_topk
    return [[rng.randint(2, config.vocab_size - 1) for _ in range(n)] for n in (k + 5, 2 * k + 3, k + 17)]


def make(model, **kw) -> LLM:
    return LLM(model=model, device="cpu", dtype="float32", max_total_tokens=4096, max_running_requests=4,
               progress=False, **kw)


def forced_override(reference: dict[str, list[int]], topk: int, rng: random.Random):
    """Draft the target's continuation up to a random depth each round, a wrong token after it.

    override(request id, output index of the round's first token, depth >= 1, proposed tokens) -> tokens."""
    cut: dict[tuple[str, int], int] = {}

    def override(request_id, first_output, depth, toks):
        ref = reference[request_id]
        pos = first_output - 1 + depth  # output index of the depth-`depth` token
        good = cut.setdefault((request_id, first_output), rng.randint(0, 5))
        out = list(toks)
        for beam in range(len(out) // topk):
            slot = beam * topk + depth % topk
            if depth <= good and pos < len(ref):
                out[slot] = ref[pos]
            elif pos < len(ref) and out[slot] == ref[pos]:
                out[slot] = (ref[pos] + 1) % 300 + 2
        return out

    return override


def force_drafts(speculator, override) -> None:
    """Replace the speculator's draft proposals through `override` (see forced_override); replaced tokens get
    log-prob 0, so they rank first in the tree."""
    propose = speculator.propose

    def forced(reqs, depth, logits):
        toks, logp = propose(reqs, depth, logits)
        new = torch.tensor([list(override(rid, pos, depth, toks[b].tolist()))
                            for b, (rid, pos) in enumerate(zip(reqs.request_ids, reqs.output_positions))],
                           dtype=toks.dtype, device=toks.device)
        assert new.shape == toks.shape, "the override must return as many tokens as proposed"
        return new, torch.where(new != toks, torch.zeros_like(logp), logp)

    speculator.propose = forced


class OnlySpecRunner:
    """A runner seen through `SpecRunner` alone: any other attribute the speculator reaches for fails."""

    MEMBERS = frozenset(n for n in (*vars(SpecRunner), *SpecRunner.__annotations__) if not n.startswith("_"))

    def __init__(self, runner):
        self._runner = runner

    def __getattr__(self, name):
        if name not in self.MEMBERS:
            raise AttributeError(f"the speculator used runner.{name}, which SpecRunner does not provide")
        return getattr(self._runner, name)


def speculate_through_spec_runner(llm: LLM) -> None:
    """Rebuild the engine's speculator on its runner seen through `SpecRunner` alone."""
    eng = llm.engine
    eng.worker.speculator = MTPSpeculator(OnlySpecRunner(eng.runner), eng.speculator.opts, eng.sampler,
                                          seed=eng.config.args.seed)


def run(llm: LLM, prompts, params=GREEDY, override=None) -> list[list[int]]:
    ids = [llm.engine.add_request(p, params, request_id=f"r{i}") for i, p in enumerate(prompts)]
    if override is not None:
        force_drafts(llm.engine.speculator, override)
    out: dict[str, list[int]] = {}
    while llm.engine.has_unfinished():
        for o in llm.engine.step():
            if o.finished:
                out[o.request_id] = o.token_ids
    return [out[i] for i in ids]


@pytest.mark.parametrize("arch", ["deepseek_v32", "glm_moe_dsa"])
@pytest.mark.parametrize("spec", list(SPEC_CONFIGS))
def test_greedy_speculation_is_lossless(arch, spec, glm_path):
    model = None if arch == "deepseek_v32" else glm_path
    plain = make(model)
    config = plain.engine.model_config
    for seed in (0, 1):
        prompts = prompts_for(config, seed)
        reference = run(plain, prompts)
        fast = make(model, **SPEC_CONFIGS[spec])
        assert run(fast, prompts) == reference  # the real (random) draft
        forced = make(model, **SPEC_CONFIGS[spec])
        ref_by_id = {f"r{i}": r for i, r in enumerate(reference)}
        topk = forced.engine.speculator.opts.topk
        assert run(forced, prompts, override=forced_override(ref_by_id, topk, random.Random(seed))) == reference
        stats = forced.engine.speculator.stats
        seen = {n for v in stats.per_request.values() for n in v}
        steps = forced.engine.speculator.opts.num_steps
        assert seen == set(range(steps + 1)), f"accepted lengths seen {sorted(seen)}, want 0..{steps}"
        m = forced.engine.metrics()
        assert m.spec_verify_steps_total == stats.verify_steps and m.spec_accepted_tokens_total > 0


@pytest.mark.parametrize("spec", ["chain2", "tree"])
def test_the_speculator_needs_only_the_spec_runner_interface(spec):
    """Chains and trees (forced long accepted paths: compaction moves KV) through a runner that has nothing but
    SpecRunner's members give the plain engine's tokens."""
    plain = make(None)
    prompts = prompts_for(plain.engine.model_config, 2)
    reference = run(plain, prompts)
    llm = make(None, **SPEC_CONFIGS[spec])
    speculate_through_spec_runner(llm)
    assert sorted(OnlySpecRunner.MEMBERS) == ["device", "dtype", "forward", "forward_mtp", "has_draft_extend_graph",
                                              "model_config", "move_kv", "num_rows", "req_to_token"]
    ref_by_id = {f"r{i}": r for i, r in enumerate(reference)}
    override = forced_override(ref_by_id, llm.engine.speculator.opts.topk, random.Random(2))
    assert run(llm, prompts, override=override) == reference
    assert max(n for v in llm.engine.speculator.stats.per_request.values() for n in v) >= 2


def test_sampled_requests_with_speculation_follow_their_seed():
    params = SamplingParams(max_tokens=12, temperature=0.8, top_p=0.9, seed=7, ignore_eos=True, detokenize=False)
    llm = make(None, **SPEC_CONFIGS["chain2"])
    prompts = prompts_for(llm.engine.model_config, 3)
    a, b = run(llm, prompts, params), run(llm, prompts, params)
    assert a == b and all(len(x) == 12 for x in a)


def test_tree_compaction_leaves_exactly_what_plain_decode_writes():
    """After rounds with off-front accepted paths, both caches at every cached position equal a plain prefill's."""
    plain = make(None)
    config = plain.engine.model_config
    prompt = prompts_for(config, 4)[1]
    reference = run(plain, [prompt], SamplingParams(max_tokens=30, ignore_eos=True, detokenize=False))[0]

    llm = make(None, **SPEC_CONFIGS["tree"])
    eng = llm.engine
    eng.add_request(prompt, SamplingParams(max_tokens=30, ignore_eos=True, detokenize=False), request_id="r0")
    force_drafts(eng.speculator, forced_override({"r0": reference}, 2, random.Random(0)))
    moved = []
    real_move = eng.runner.move_kv
    eng.runner.move_kv = lambda src, dst: (moved.append(len(src)), real_move(src, dst))[1]
    req = eng.requests["r0"]
    while len(req.output_ids) < 16:
        eng.step()
    assert sum(moved) > 0, "no accepted path left the front: compaction not exercised"
    n = req.seq_len
    tokens = req.token_slice(0, n)
    assert tokens == (prompt + reference)[:n]
    slots = eng.runner.req_to_token[req.row, :n].long()
    kv = eng.runner.kv_cache

    driver = PagedDriver(eng.runner.model, config, page_size=1, max_len=n + 4)
    driver.add(tokens, reserve=0)
    driver.prefill([0])
    ref_slots = driver.table.req_to_token[driver.reqs[0]["row"], :n].long()
    for layer in range(config.num_hidden_layers):
        assert torch.allclose(kv.mla[layer][slots], driver.kv.mla[layer][ref_slots], atol=1e-4), layer
        if kv.index_k[layer] is not None:
            assert torch.allclose(kv.index_k[layer][slots], driver.kv.index_k[layer][ref_slots], atol=1e-4), layer
    driver.release_all()
    eng.abort("r0")
    eng.step()


@pytest.mark.parametrize("args,field,hint", [
    (dict(speculative_num_steps=2, speculative_topk=2, speculative_num_draft_tokens=4, page_size=4),
     "speculative_topk", "page_size 1"),
    (dict(speculative_num_steps=2, speculative_num_draft_tokens=5), "speculative_num_draft_tokens", "3"),
    (dict(speculative_num_steps=2, speculative_topk=2), "speculative_num_draft_tokens", "must be set"),
    (dict(speculative_num_steps=2, speculative_topk=2, speculative_num_draft_tokens=4, page_size=1,
          index_share_for_mtp_iteration=True), "index_share_for_mtp_iteration", "chains"),
    (dict(speculative_topk=2), "speculative_num_steps", "speculative_num_steps >= 1"),
])
def test_invalid_speculative_configs_fail_at_start_up(args, field, hint):
    with pytest.raises(ConfigError) as e:
        make(None, **args)
    assert field in str(e.value) and hint in str(e.value)


def test_speculation_needs_an_mtp_layer(tmp_path):
    hf, kw = build_hf("deepseek_v32", seed=2)
    path = save_hf(hf, kw, str(tmp_path / "no_mtp"))
    with pytest.raises(ConfigError, match="MTP"):
        make(path, speculative_num_steps=2)


def test_static_graph_buffers_keep_speculation_lossless():
    """The padded static-buffer path of every captured step kind (run eagerly on CPU) stays lossless; the speculator
    pads its draft extends for the graph knowing only what SpecRunner tells it."""
    plain = make(None)
    prompts = prompts_for(plain.engine.model_config, 6)
    reference = run(plain, prompts)
    for spec in ("chain2", "tree"):
        llm = make(None, **SPEC_CONFIGS[spec])
        speculate_through_spec_runner(llm)
        static_fast_paths(llm.engine.runner, llm.engine.speculator.layout)
        assert llm.engine.speculator.runner.has_draft_extend_graph
        replays = count_replays(llm.engine.runner.graphs)
        assert run(llm, prompts) == reference
        assert replays[StepKind.VERIFY] > 0 and replays[StepKind.DRAFT_EXTEND] > 0 and replays[StepKind.DRAFT] > 0


# -- simulated acceptance (benchmarks only) -------------------------------------------------------------------------
@pytest.mark.parametrize("accept_len", [1.0, 2.5, 3.2, 4.0])
def test_simulated_acceptance_yields_its_mean_tokens_per_round(accept_len):
    llm = make(None, speculative_num_steps=3, speculative_simulate_accept_len=accept_len)
    eng = llm.engine
    prompts = prompts_for(eng.model_config, 7)
    outs = run(llm, prompts + prompts[:1], SamplingParams(max_tokens=90, ignore_eos=True, detokenize=False))
    assert all(len(o) == 90 for o in outs)  # truncated to max_tokens whatever a round yields
    stats = eng.speculator.stats
    assert stats.verify_steps > 80
    per_round = (stats.accepted_tokens + stats.verify_steps) / stats.verify_steps
    assert abs(per_round - accept_len) <= 0.05 * accept_len, per_round
    m = eng.metrics()
    assert m.spec_simulated_accept_len == accept_len
    eng.check_no_leaks()


def test_simulated_acceptance_frees_slots_on_abort_and_preemption():
    llm = LLM(model=None, device="cpu", dtype="float32", max_total_tokens=220, max_running_requests=4,
              chunked_prefill_size=40, progress=False, speculative_num_steps=3,
              speculative_simulate_accept_len=3.5)
    eng = llm.engine
    prompts = prompts_for(eng.model_config, 8) + prompts_for(eng.model_config, 9)[:1]
    params = SamplingParams(max_tokens=80, ignore_eos=True, detokenize=False)
    ids = [eng.add_request(p, params) for p in prompts]
    steps = 0
    while eng.has_unfinished():
        eng.step()
        steps += 1
        if steps == 12:
            eng.abort(ids[1])
    assert eng.metrics().preemptions_total > 0
    eng.check_no_leaks()


@pytest.mark.parametrize("args,hint", [
    (dict(speculative_simulate_accept_len=2.0), "needs speculative decoding"),
    (dict(speculative_num_steps=3, speculative_simulate_accept_len=4.5), "outside [1, 4]"),
    (dict(speculative_num_steps=3, speculative_simulate_accept_len=0.5), "outside [1, 4]"),
    (dict(speculative_num_steps=2, speculative_topk=2, speculative_num_draft_tokens=4, page_size=1,
          speculative_simulate_accept_len=2.0), "chains only"),
    (dict(speculative_num_steps=2, speculative_simulate_accept_len=-1.0), ">= 0"),
])
def test_simulated_acceptance_arguments_are_checked(args, hint):
    with pytest.raises(ConfigError) as e:
        make(None, **args)
    assert "speculative_simulate_accept_len" in str(e.value) and hint in str(e.value)


def test_speculation_without_an_mtp_layer_fails_before_any_rank_starts(tmp_path):
    """Under tensor parallelism the same one-line error, raised by the engine before it starts a process."""
    import multiprocessing

    hf, kw = build_hf("deepseek_v32", seed=2)
    path = save_hf(hf, kw, str(tmp_path / "no_mtp"))
    with pytest.raises(ConfigError, match="MTP"):
        make(path, speculative_num_steps=2, tensor_parallel_size=2)
    assert not multiprocessing.active_children()
