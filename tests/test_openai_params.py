"""Engine side of the OpenAI parameters: prompt logprobs (echo), top logprobs, penalties, max_tokens 0.

Every reference is the model itself, run outside the engine: the tiny model's logits at every position of
a sequence (harness.PagedDriver, one prefill with logits for all tokens).
"""

from __future__ import annotations

import pytest
import torch

from harness import PagedDriver
from minidsa import LLM, SamplingParams
from minidsa.common.request import InvalidRequest

PROMPT = [5, 17, 923, 4021, 77, 1500, 2600, 31, 8, 9000, 12, 13]


def model_logits(llm, tokens: list[int]) -> torch.Tensor:
    """[len(tokens), vocab] fp32 logits after each position, computed outside the engine."""
    driver = PagedDriver(llm.engine.runner.model, llm.engine.model_config, max_len=len(tokens) + 8)
    driver.add(tokens, reserve=0)
    logits = driver.prefill([0], logits="all")[0][1].logits.float()
    driver.release_all()
    return logits


@pytest.mark.parametrize("chunk", [0, 5])
def test_prompt_logprobs_are_the_models_own(tiny_llm, chunk):
    llm = tiny_llm if not chunk else LLM(device="cpu", dtype="float32", progress=False, chunked_prefill_size=chunk,
                                         max_total_tokens=4096)
    out = llm.generate([PROMPT], SamplingParams(max_tokens=0, prompt_logprobs=3))[0]
    assert out.token_ids == [] and out.finish_reason == "length"
    ref = torch.log_softmax(model_logits(tiny_llm, PROMPT), dim=-1)
    assert out.prompt_logprobs[0] is None and out.prompt_top_logprobs[0] is None
    assert len(out.prompt_logprobs) == len(PROMPT)
    for p in range(1, len(PROMPT)):
        assert out.prompt_logprobs[p] == pytest.approx(ref[p - 1, PROMPT[p]].item(), abs=1e-4)
        top = ref[p - 1].topk(3)
        assert list(out.prompt_top_logprobs[p]) == top.indices.tolist()
        assert list(out.prompt_top_logprobs[p].values()) == pytest.approx(top.values.tolist(), abs=1e-4)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_top_logprobs_of_generated_tokens(tiny_llm, temperature):
    params = SamplingParams(max_tokens=5, logprobs=True, top_logprobs=4, temperature=temperature, seed=3,
                            ignore_eos=True)
    out = tiny_llm.generate([PROMPT], params)[0]
    ref = torch.log_softmax(model_logits(tiny_llm, PROMPT + out.token_ids), dim=-1)
    assert len(out.top_logprobs) == len(out.token_ids) == 5
    for t, (tok, lp, top) in enumerate(zip(out.token_ids, out.logprobs, out.top_logprobs)):
        row = ref[len(PROMPT) - 1 + t]
        assert lp == pytest.approx(row[tok].item(), abs=1e-4)  # the model's logprob, before temperature
        want = row.topk(4)
        assert list(top) == want.indices.tolist()
        assert list(top.values()) == pytest.approx(want.values.tolist(), abs=1e-4)
        if temperature == 0.0:
            assert next(iter(top)) == tok  # greedy picks the likeliest


@pytest.mark.parametrize("penalties", [dict(frequency_penalty=2.0), dict(presence_penalty=1.5),
                                       dict(repetition_penalty=1.8), dict(frequency_penalty=-1.0,
                                                                          repetition_penalty=0.7)])
def test_penalties_match_their_definition(tiny_llm, penalties):
    n = 6
    out = tiny_llm.generate([PROMPT], SamplingParams(max_tokens=n, ignore_eos=True, **penalties))[0]
    plain = tiny_llm.generate([PROMPT], SamplingParams(max_tokens=n, ignore_eos=True))[0]
    freq = penalties.get("frequency_penalty", 0.0)
    pres = penalties.get("presence_penalty", 0.0)
    rep = penalties.get("repetition_penalty", 1.0)
    logits = model_logits(tiny_llm, PROMPT + out.token_ids)
    for t in range(n):
        x = logits[len(PROMPT) - 1 + t].clone()
        counts = torch.bincount(torch.tensor(out.token_ids[:t], dtype=torch.int64), minlength=x.numel()).float()
        seen = (counts > 0) | torch.isin(torch.arange(x.numel()), torch.tensor(PROMPT))
        x = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)
        x = x - freq * counts - pres * (counts > 0).float()
        assert out.token_ids[t] == int(x.argmax())
    if freq > 0 or pres > 0:  # the random tiny model repeats itself greedily; penalties must change that
        assert len(set(out.token_ids)) >= len(set(plain.token_ids))


def test_bad_values_are_named():
    for params, name in ((SamplingParams(max_tokens=0), "max_tokens"),
                         (SamplingParams(top_logprobs=21, logprobs=True), "top_logprobs"),
                         (SamplingParams(top_logprobs=2), "top_logprobs"),
                         (SamplingParams(prompt_logprobs=-1), "prompt_logprobs"),
                         (SamplingParams(presence_penalty=2.5), "presence_penalty"),
                         (SamplingParams(repetition_penalty=0.0), "repetition_penalty")):
        with pytest.raises(InvalidRequest, match=name):
            params.validate()


def test_preempted_request_keeps_its_prompt_logprobs(tiny_llm):
    """Scoring resumes where it stopped: a request re-prefilled after preemption is not scored twice."""
    engine = tiny_llm.engine
    rid = engine.add_request(PROMPT, SamplingParams(max_tokens=3, prompt_logprobs=1, ignore_eos=True))
    req = engine.requests[rid]
    while not req.output_ids:  # prefill: prompt scored, first token sampled (and delivered)
        engine.step()
    first = list(req.prompt_logprobs)
    engine.scheduler._preempt(req)  # as the scheduler does under KV pressure
    outs = {}
    while engine.has_unfinished():
        for o in engine.step():
            outs[o.request_id] = o
    assert outs[rid].prompt_logprobs == first and len(first) == len(PROMPT)


def test_speculative_engine_refuses_what_it_cannot_honour():
    """With MTP speculation the verify step samples by its own rules: logprobs and penalties are refused,
    each naming its field, and nothing is left in the engine."""
    llm = LLM(device="cpu", dtype="float32", progress=False, speculative_num_steps=1, max_total_tokens=2048)
    for kwargs, name in ((dict(logprobs=True), "logprobs"), (dict(prompt_logprobs=0, max_tokens=0), "prompt_logprobs"),
                         (dict(presence_penalty=0.5), "presence_penalty"),
                         (dict(frequency_penalty=0.5), "frequency_penalty"),
                         (dict(repetition_penalty=1.1), "repetition_penalty")):
        with pytest.raises(InvalidRequest, match=f"SamplingParams.{name} is not supported with speculative"):
            llm.engine.add_request(PROMPT, SamplingParams(**kwargs))
    assert not llm.engine.has_unfinished()
