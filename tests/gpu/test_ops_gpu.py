"""GPU: the OpenAI parameters on the fast paths (bf16, CUDA graphs for decode, Triton kernels).

Prompt logprobs come from the eager prefill, generated-token logprobs and top logprobs from the decode graph;
both are checked against the same model's log-softmax over the whole sequence (one eager prefill with logits
at every position), within bf16 tolerance. Penalties run through the graph path's sampler on the device.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

PROMPT = [5, 17, 923, 4021, 77, 1500, 2600, 31, 8, 9000, 12, 13] * 30  # longer than index_topk


@pytest.fixture(scope="module")
def llm():
    from minidsa import LLM

    return LLM(progress=False, max_running_requests=8, cuda_graph_max_bs=8, enable_compile=False)


def _reference(llm, tokens):
    from minidsa import SamplingParams

    engine = llm.engine
    rid = engine.add_request(tokens, SamplingParams(max_tokens=1, prompt_logprobs=0))
    out = {}
    while engine.has_unfinished():
        for o in engine.step():
            out[o.request_id] = o
    return out[rid].prompt_logprobs  # teacher-forced logprobs of every token after the first


def test_logprobs_on_the_graph_path_match_the_prefill(llm):
    from minidsa import SamplingParams

    out = llm.generate([PROMPT], SamplingParams(max_tokens=8, logprobs=True, top_logprobs=5, ignore_eos=True,
                                                prompt_logprobs=1))[0]
    assert llm.engine.runner.graphs is not None  # decode replays a graph
    assert len(out.top_logprobs) == 8 and all(len(t) == 5 for t in out.top_logprobs)
    assert all(next(iter(t)) == tok for t, tok in zip(out.top_logprobs, out.token_ids))  # greedy
    ref = _reference(llm, PROMPT + out.token_ids)
    assert out.prompt_logprobs[0] is None
    torch.testing.assert_close(torch.tensor(out.prompt_logprobs[1:]), torch.tensor(ref[1:len(PROMPT)]),
                               atol=0.05, rtol=0.02)
    torch.testing.assert_close(torch.tensor(out.logprobs), torch.tensor(ref[len(PROMPT):]), atol=0.05, rtol=0.02)


def test_penalties_on_gpu(llm):
    from minidsa import SamplingParams

    plain = llm.generate([PROMPT], SamplingParams(max_tokens=16, ignore_eos=True))[0]
    penalised = llm.generate([PROMPT], SamplingParams(max_tokens=16, ignore_eos=True, frequency_penalty=2.0,
                                                      presence_penalty=2.0, repetition_penalty=1.5))[0]
    assert len(set(penalised.token_ids)) >= len(set(plain.token_ids))
    assert len(set(penalised.token_ids)) > 8  # with these penalties the random model stops repeating itself
