"""Sampling: greedy exactness, seeded reproducibility, the filters, the sampled distribution, validation."""

from __future__ import annotations

import math
import random

import pytest
import torch

from minidsa.common.request import InvalidRequest, SamplingParams
from minidsa.common.sampling import (Sampler, SamplingBatch, as_int64, exponential_noise, exponential_noise_reference,
                              race_scores, row_key, sample)

V = 16


def _logits(rows: int, vocab: int = V, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, vocab, generator=g) * 2


def _batch(params: list[SamplingParams], positions: list[int] | None = None, vocab: int = V) -> SamplingBatch:
    return SamplingBatch.build([p.validate() for p in params], positions or [0] * len(params),
                               random.Random(0), vocab, "cpu")


@pytest.mark.smoke
def test_greedy_is_exact_argmax():
    logits = _logits(64, vocab=1000)
    ids, _ = sample(logits, _batch([SamplingParams()] * 64, vocab=1000))
    assert torch.equal(ids, logits.argmax(-1))


def test_noise_is_a_pure_function_of_key_and_vocab_id():
    keys = torch.tensor([as_int64(row_key(7, 3)), as_int64(row_key(7, 4)), as_int64(row_key(8, 3))])
    a = exponential_noise(keys, 5000)
    b = exponential_noise(keys.flip(0), 5000).flip(0)
    assert torch.equal(a, b)
    assert (a > 0).all() and torch.isfinite(a).all()
    assert not torch.equal(a[0], a[1]) and not torch.equal(a[0], a[2])
    # Exp(1): mean 1, variance 1.
    assert abs(a.mean().item() - 1) < 0.03 and abs(a.var().item() - 1) < 0.1


def test_noise_bits_match_the_python_definition():
    """Pins the hash bit for bit (int32 wrap-around), so CPU and GPU runs sample the same tokens."""
    keys = [row_key(7, 3), row_key(1, 0), 0, (1 << 64) - 1]
    noise = exponential_noise(torch.tensor([as_int64(k) for k in keys]), 129280)
    for r, key in enumerate(keys):
        for v in (0, 1, 2, 999, 65536, 129279):
            assert noise[r, v].item() == pytest.approx(exponential_noise_reference(key, v), rel=1e-6)


def test_seeded_rows_do_not_depend_on_batch_composition():
    logits = _logits(1, vocab=500, seed=3)
    p = SamplingParams(temperature=1.0, seed=42)
    alone = [sample(logits, _batch([p], [pos], vocab=500))[0].item() for pos in range(20)]
    others = [SamplingParams(temperature=0.7), SamplingParams(), SamplingParams(temperature=1.3, seed=1)]
    for pos in range(20):
        rows = [others[0], p, others[1], others[2]]
        batch_logits = torch.cat([_logits(1, 500, 9), logits, _logits(1, 500, 8), _logits(1, 500, 7)])
        ids, _ = sample(batch_logits, _batch(rows, [pos + 5, pos, pos, 2], vocab=500))
        assert ids[1].item() == alone[pos]
    # Different output positions draw different noise: the sequence is not constant.
    assert len(set(alone)) > 3


def test_distribution_matches_softmax():
    """Exponential race over hashed noise samples from softmax(logits / T) (chi-square, fixed seeds)."""
    n = 8000
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -0.5, -1.0, -2.0, -3.0]])
    temp = 1.5
    params = [SamplingParams(temperature=temp, seed=s) for s in range(n)]
    ids, _ = sample(logits.expand(n, -1), _batch(params, vocab=8))
    counts = torch.bincount(ids, minlength=8).double()
    expected = torch.softmax(logits[0].double() / temp, 0) * n
    chi2 = ((counts - expected) ** 2 / expected).sum().item()
    assert chi2 < 24.3, (counts, expected)  # 7 dof, p = 0.001


def test_top_k_restricts_to_the_k_best():
    n = 3000
    logits = _logits(1, vocab=50, seed=5)
    allowed = set(logits[0].topk(5).indices.tolist())
    params = [SamplingParams(temperature=1.0, top_k=5, seed=s) for s in range(n)]
    ids = sample(logits.expand(n, -1), _batch(params, vocab=50))[0].tolist()
    assert set(ids) <= allowed
    assert len(set(ids)) == 5  # and uses all of them


def test_top_p_restricts_to_the_nucleus():
    n = 3000
    logits = _logits(1, vocab=50, seed=6)
    probs = torch.softmax(logits[0], 0)
    order = probs.argsort(descending=True)
    cum = probs[order].cumsum(0)
    top_p = 0.6
    nucleus = set(order[: int((cum < top_p).sum()) + 1].tolist())  # smallest prefix reaching top_p
    params = [SamplingParams(temperature=1.0, top_p=top_p, seed=s) for s in range(n)]
    ids = sample(logits.expand(n, -1), _batch(params, vocab=50))[0].tolist()
    assert set(ids) <= nucleus
    assert len(set(ids)) == len(nucleus)


def test_top_k_and_top_p_and_min_p_mixed_rows():
    """Rows with different filters in one batch each keep their own allowed set."""
    n = 600
    logits = _logits(1, vocab=40, seed=7).expand(n, -1)
    probs = torch.softmax(logits[0], 0)
    kinds = [SamplingParams(temperature=1.0, top_k=3), SamplingParams(temperature=1.0, min_p=0.3),
             SamplingParams(temperature=1.0), SamplingParams()]
    params = [SamplingParams(**{**{f: getattr(kinds[i % 4], f) for f in ("temperature", "top_k", "min_p")},
                                "seed": i}) for i in range(n)]
    ids = sample(logits, _batch(params, vocab=40))[0].tolist()
    top3 = set(probs.topk(3).indices.tolist())
    min_p_set = set(torch.nonzero(probs >= 0.3 * probs.max()).flatten().tolist())
    assert {ids[i] for i in range(0, n, 4)} <= top3
    assert {ids[i] for i in range(1, n, 4)} <= min_p_set
    assert len({ids[i] for i in range(2, n, 4)}) > len(min_p_set)  # unfiltered rows range wider
    assert {ids[i] for i in range(3, n, 4)} == {int(probs.argmax())}


def test_unseeded_rows_follow_the_sampler_seed():
    logits = _logits(4, vocab=300)
    params = [SamplingParams(temperature=1.0)] * 4
    a = Sampler(300, "cpu", seed=1)(logits, params, [0] * 4)[0]
    b = Sampler(300, "cpu", seed=1)(logits, params, [0] * 4)[0]
    c = Sampler(300, "cpu", seed=2)(logits, params, [0] * 4)[0]
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_logprobs_are_model_log_probabilities_of_the_chosen_ids():
    logits = _logits(3, vocab=100)
    params = [SamplingParams(logprobs=True), SamplingParams(temperature=0.9, seed=1, logprobs=True),
              SamplingParams()]
    ids, lp = sample(logits, _batch(params, vocab=100))
    ref = torch.log_softmax(logits, -1).gather(1, ids[:, None]).squeeze(1)
    assert torch.allclose(lp, ref)


@pytest.mark.parametrize("field,value", [
    ("max_tokens", -1), ("max_tokens", 0), ("max_tokens", 2.5), ("temperature", float("nan")),
    ("temperature", -0.1), ("temperature", float("inf")), ("top_p", 0.0), ("top_p", 1.5), ("top_k", -2),
    ("min_p", 1.5), ("seed", "x"), ("stop", [""]), ("stop", [3]), ("stop_token_ids", [-1]),
    ("ignore_eos", "yes"),
])
@pytest.mark.smoke
def test_invalid_params_name_the_field(field, value):
    with pytest.raises(InvalidRequest, match=field):
        SamplingParams(**{field: value}).validate()


def test_validate_normalises():
    p = SamplingParams(stop="END", top_k=-1, temperature=1).validate()
    assert p.stop == ["END"] and p.top_k == 0 and isinstance(p.temperature, float)
    with pytest.raises(InvalidRequest, match="stop"):
        SamplingParams(stop=["x"], detokenize=False).validate()
    assert math.isclose(SamplingParams(top_p=1).validate().top_p, 1.0)


# -- the one-pass race (kernels/sampling.py) under Triton's interpreter -------------------------------------------

def _race_inputs(rows: int, vocab: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    temperature = torch.rand(rows, generator=g) * 1.5 + 0.2
    keys = torch.tensor([as_int64(row_key(seed, r)) for r in range(rows)])
    greedy = torch.arange(rows) % 3 == 2
    return torch.randn(rows, vocab, generator=g) * 3, temperature, keys, greedy


def _assert_same_or_tied(ids: torch.Tensor, ref: torch.Tensor, x, temperature, keys, greedy) -> None:
    """ids equal the reference's, except where the two scores are equal up to float rounding."""
    scores = race_scores(x, temperature, keys, greedy)
    for r in torch.nonzero(ids != ref).flatten().tolist():
        a, b = scores[r, ids[r]].item(), scores[r, ref[r]].item()
        assert a == pytest.approx(b, rel=1e-6, abs=1e-6), (r, ids[r].item(), ref[r].item(), a, b)


@pytest.fixture(scope="module")
def triton_race():
    from triton_interp import import_kernels_interpreted

    if not import_kernels_interpreted():
        pytest.skip("compiled Triton is loaded in this process (GPU runs: tests/gpu/test_sampling_gpu.py)")
    from minidsa.common.sampling import race_for

    return race_for("triton")


def test_one_pass_race_picks_the_reference_ids(triton_race):
    """Vocab over two kernel chunks, a ragged tail, greedy and sampled rows, bf16 and fp32 logits, a row stride."""
    from minidsa.common.sampling import race_argmax

    x, temperature, keys, greedy = _race_inputs(6, 5000)
    for logits in (x, x.bfloat16(), torch.cat([x, x], dim=1)[:, 3:5003]):
        ids = triton_race(logits, temperature, keys, greedy)
        ref = race_argmax(logits, temperature, keys, greedy)
        assert ids.dtype == torch.int64 and ids.shape == (6,)
        _assert_same_or_tied(ids, ref, logits, temperature, keys, greedy)
        assert torch.equal(ids[greedy], logits[greedy].float().argmax(-1))


def test_one_pass_race_breaks_ties_to_the_lowest_id(triton_race):
    """torch.argmax's rule, within a block, across blocks and across chunks."""
    vocab = 9000
    x = torch.full((3, vocab), -5.0)
    x[0, [7, 700]] = 4.0  # one block
    x[1, [1030, 2050]] = 4.0  # two blocks of one chunk
    x[2, [5000, 4100, 8999]] = 4.0  # chunks 1 and 2: the lowest is 4100
    ids = triton_race(x, torch.ones(3), torch.zeros(3, dtype=torch.int64), torch.ones(3, dtype=torch.bool))
    assert ids.tolist() == [7, 1030, 4100]


def test_sampler_with_the_one_pass_race_samples_what_the_reference_samples(triton_race):
    """Through Sampler: plain temperature rows, filtered rows (the race runs on the filtered logits), greedy rows."""
    logits = _logits(8, vocab=3000, seed=11)
    params = [SamplingParams(temperature=0.8, seed=1), SamplingParams(), SamplingParams(temperature=1.2, seed=2),
              SamplingParams(temperature=1.0, top_k=20, seed=3), SamplingParams(temperature=0.7, top_p=0.9, seed=4),
              SamplingParams(temperature=1.0, min_p=0.05, seed=5), SamplingParams(temperature=1.0, seed=6),
              SamplingParams(temperature=2.0, top_k=5, top_p=0.5, seed=7)]
    positions = list(range(8))
    for rows in (params[:3] + params[6:7], params):  # no filters: raw logits; with filters
        n = len(rows)
        fast = Sampler(3000, "cpu", race=triton_race)(logits[:n], rows, positions[:n]).ids
        ref = Sampler(3000, "cpu")(logits[:n], rows, positions[:n]).ids
        assert torch.equal(fast, ref)
