"""Structured outputs: response_format checked and compiled (minidsa/chat/grammar.py), the token masks in the
sampler (torch and Triton), and the engine: two-phase launch under overlap, prefix caching, tensor parallelism.

The embedded model's weights are random, so its answers below are JSON only because of the grammar. The schemas
it generates for are bounded (short strings, small integers, enums, short arrays), so every answer completes
within max_tokens. Unbounded shapes (free strings, numbers, json_object) are checked by walking written documents
through the grammar, and json_object's generations as JSON prefixes (tests/json_check.py, no xgrammar there).
"""

from __future__ import annotations

import json
import sys

import pytest
import torch

from json_check import check_against, is_json_prefix
from minidsa import LLM, SamplingParams
from minidsa.chat.grammar import StructuredOutputs, parse_response_format
from minidsa.engine import Engine
from minidsa.common.request import InvalidRequest
from minidsa.common.sampling import (NOISE_FLOOR, Sampler, TokenMask, apply_token_mask, as_int64, exponential_noise,
                              exponential_noise_reference, row_key, unpack_bitmask)
from minidsa.common.tokenizer import load_tokenizer

VOCAB = 129280  # the embedded preset's (the tokenizer has 128815 ids: masks are padded)
EOS = 1  # the preset's eos_token_id


def json_schema(schema, strict: bool = True) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": strict}}


# Bounded schemas the random model generates for (at most ~70 tokens each).
PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 4}, "age": {"type": "integer", "minimum": 0, "maximum": 99},
    "ok": {"type": "boolean"}, "color": {"enum": ["red", "green", "blue"]}},
    "required": ["name", "age", "ok", "color"], "additionalProperties": False}
NESTED = {"type": "object", "properties": {
    "id": {"type": "integer", "minimum": 0, "maximum": 9},
    "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "minItems": 1, "maxItems": 2},
    "inner": {"type": "object", "properties": {"flag": {"type": "boolean"}, "none": {"type": "null"}},
              "required": ["flag", "none"], "additionalProperties": False}},
    "required": ["id", "tags", "inner"], "additionalProperties": False}
CODE = {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{2}$"}},
        "required": ["code"], "additionalProperties": False}
CHOICE = {"anyOf": [{"type": "boolean"}, {"type": "null"}, {"enum": ["yes", "no"]}]}
DIGITS = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 2, "maxItems": 3}
GENERATED = {"person": PERSON, "nested": NESTED, "code": CODE, "choice": CHOICE, "digits": DIGITS}
MAX_TOKENS = 96  # above any answer of the schemas above, byte by byte
PROMPTS = ["Describe a person as JSON.", [5, 17, 902, 33, 8, 4096, 77]]


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer()


@pytest.fixture(scope="module")
def structured(tok):
    return StructuredOutputs(tok, VOCAB, [EOS])


def _ids(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


# -- response_format: shapes and schemas ------------------------------------------------------------------------

@pytest.mark.smoke
def test_response_format_shapes():
    assert parse_response_format(None) is None
    assert parse_response_format({"type": "text"}) is None
    fmt = parse_response_format({"type": "json_object"})
    assert (fmt.type, fmt.schema, fmt.strict) == ("json_object", {"type": "object"}, False)
    fmt = parse_response_format(json_schema(PERSON))
    assert (fmt.type, fmt.schema, fmt.strict) == ("json_schema", PERSON, True)
    assert not parse_response_format(json_schema(PERSON, strict=False)).strict
    # the key is the schema's canonical JSON, property order kept (it is the order the grammar generates in)
    swapped = {**PERSON, "properties": dict(reversed(list(PERSON["properties"].items())))}
    assert parse_response_format(json_schema(swapped)).key != fmt.key
    assert parse_response_format(json_schema(json.loads(json.dumps(PERSON)))).key == fmt.key


@pytest.mark.parametrize("response_format, message", [
    ("json", "must be an object"),
    ({"type": "xml"}, "type 'xml' is not supported"),
    ({"type": "json_schema"}, "needs 'json_schema'"),
    ({"type": "json_schema", "json_schema": {"name": "x"}}, "json_schema.schema is missing"),
    ({"type": "json_schema", "json_schema": {"schema": [1]}}, "must be a JSON Schema object"),
    ({"type": "json_schema", "json_schema": {"schema": {}, "strict": "yes"}}, "strict must be true or false"),
    ({"type": "json_schema", "json_schema": {"schema": {"maximum": float("nan")}}}, "is not JSON"),
])
def test_malformed_response_formats_are_named(response_format, message):
    with pytest.raises(InvalidRequest, match="SamplingParams.response_format") as e:
        parse_response_format(response_format)
    assert message in str(e.value)


@pytest.mark.parametrize("schema, message", [
    ({"type": "strnig"}, 'Unsupported type "strnig"'),
    ({"type": "object", "required": "name"}, "required must be an array"),
    ({"$ref": "#/$defs/missing"}, "missing"),
    ({"type": "string", "pattern": "[a-"}, "Unclosed"),
    ({"type": "integer", "minimum": 5, "maximum": 1}, "range"),
    (False, "cannot accept any value"),
])
def test_malformed_schemas_are_invalid_requests(structured, schema, message):
    with pytest.raises(InvalidRequest, match="^SamplingParams.response_format json_schema: the schema cannot be used: "
                       ) as e:
        structured.compile(parse_response_format(json_schema(schema)))
    assert message in str(e.value) and "/project/" not in str(e.value)  # the library's log prefix is cut


NUMBERS_AND_NESTING = {"type": "object", "properties": {
    "id": {"type": "integer"}, "score": {"type": "number"}, "tags": {"type": "array", "items": {"type": "string"}},
    "kind": {"enum": ["a", "b"]},
    "meta": {"type": "object", "properties": {"on": {"type": "boolean"}, "none": {"type": "null"}},
             "required": ["on"]}},
    "required": ["id", "kind", "meta"]}
SHAPES = [  # (response_format, documents it accepts, texts it rejects)
    (json_schema(NUMBERS_AND_NESTING),
     [{"id": -3, "score": 2500.5, "tags": ["x", "y z"], "kind": "b", "meta": {"on": True, "none": None}},
      {"id": 0, "kind": "a", "meta": {"on": False}}],
     ['{"id": 1.5', '{"kind": "a"', '{"id": 1, "kind": "c"', '{"id": 1, "kind": "a", "meta": {}}']),
    (json_schema({"type": "string", "pattern": "^[a-z]+@[a-z]+\\.com$"}), ["bob@mail.com"], ['"Bob', '"bob@mail.org']),
    (json_schema({"type": "array", "items": {"type": "number"}, "minItems": 1, "maxItems": 2}),
     [[1.25], [-0.5, 3e-07]], ["[]", "[1, 2, 3"]),
    (json_schema({"type": ["integer", "null"]}), [None, 42], ["true", "4.2"]),
    ({"type": "json_object"}, [{"a": [1, {"b": None}], "c": "d"}, {}], ["[1", '"text"', "42"]),
    # strict forbids properties the schema does not list; without it JSON Schema's default allows them
    (json_schema({"type": "object", "properties": {"a": {"type": "integer"}}}, strict=False),
     [{"a": 1, "b": [2]}], ['{"a": "1"']),
    (json_schema({"type": "object", "properties": {"a": {"type": "integer"}}}), [{"a": 1}], ['{"a": 1, "b"']),
]


@pytest.mark.parametrize("response_format, documents, rejected", SHAPES)
def test_grammars_accept_their_documents_and_reject_others(structured, tok, response_format, documents, rejected):
    fmt = parse_response_format(response_format)
    bitmask = structured.allocate_bitmask(1)
    for doc in documents:
        state = structured.new_state(fmt)
        for token in _ids(tok, json.dumps(doc)) + [EOS]:
            assert not state.terminated
            assert state.fill_mask(bitmask, 0)  # it constrains, and allows the document's next token
            assert unpack_bitmask(bitmask, VOCAB)[0, token], (doc, tok.decode([token]))
            assert state.accept([token]) == 1
        assert state.terminated  # a complete value, then the stop token
    for text in rejected:
        ids = _ids(tok, text)
        assert structured.new_state(fmt).accept(ids) < len(ids), text


def test_compiled_grammars_are_cached_and_the_cache_is_bounded(tok):
    cache = StructuredOutputs(tok, VOCAB, [EOS], cache_size=2)
    a, b, c = (parse_response_format(json_schema({"enum": [n]})) for n in ("a", "b", "c"))
    first = cache.compile(a)
    assert cache.compile(parse_response_format(json_schema({"enum": ["a"]}))) is first
    cache.compile(b)
    cache.compile(a)  # a is the most recent: c evicts b
    cache.compile(c)
    assert cache.compile(a) is first and list(cache._cache) == [c.key, a.key]


def test_no_stop_token_is_refused(tok):
    with pytest.raises(InvalidRequest, match="end-of-sequence token"):
        StructuredOutputs(tok, VOCAB, [])


# -- the per-request state: rollback, the trigger token, draft masks ---------------------------------------------

def _masks_by_stepping(structured, fmt, prefix: list[int], tokens: list[int]) -> torch.Tensor:
    """The masks before each of `tokens` (and after the last), from a fresh state fed one token at a time."""
    state = structured.new_state(fmt)
    assert state.accept(prefix) == len(prefix)
    out = structured.allocate_bitmask(len(tokens) + 1)
    for i, t in enumerate(tokens):
        state.fill_mask(out, i)
        assert state.accept([t]) == 1
    state.fill_mask(out, len(tokens))
    return out


def test_rollback_and_draft_masks_leave_the_state_as_it_was(structured, tok):
    fmt = parse_response_format(json_schema(PERSON))
    ids = _ids(tok, json.dumps({"name": "Ann", "age": 7, "ok": True, "color": "red"}))
    state = structured.new_state(fmt)
    assert state.accept(ids[:3]) == 3
    before = structured.allocate_bitmask(1)
    state.fill_mask(before, 0)

    draft = ids[3:8]
    masks = structured.allocate_bitmask(len(draft) + 1)
    assert state.fill_draft_masks(draft, masks, 0) == len(draft)
    assert torch.equal(masks, _masks_by_stepping(structured, fmt, ids[:3], draft))
    after = structured.allocate_bitmask(1)
    state.fill_mask(after, 0)
    assert torch.equal(before, after) and state.num_accepted == 3

    # a draft the grammar leaves at its third token: rows up to that token's position, then all-ones
    wrong = draft[:2] + [EOS] + draft[3:]  # an end mid-value
    masks.zero_()
    assert state.fill_draft_masks(wrong, masks, 0) == 2
    assert torch.equal(masks[:3], _masks_by_stepping(structured, fmt, ids[:3], draft[:2])[:3])
    assert not unpack_bitmask(masks[2:3], VOCAB)[0, wrong[2]]
    assert (masks[3:] == -1).all()

    # accept / rollback: back to any earlier point, then forward again
    assert state.accept(ids[3:]) == len(ids) - 3
    state.rollback(len(ids) - 5)
    assert state.num_accepted == 5 and state.accept(ids[5:] + [EOS]) == len(ids) - 4 and state.terminated
    state.rollback(1)
    assert not state.terminated and state.binding
    with pytest.raises(ValueError, match="cannot roll back"):
        state.rollback(len(ids) + 1)


def test_the_grammar_binds_after_the_trigger_token(structured, tok):
    fmt = parse_response_format(json_schema(CODE))
    trigger = 128799  # any token; a reasoning model's </think>
    state = structured.new_state(fmt, after_token_id=trigger)
    bitmask = structured.allocate_bitmask(1)
    assert state.accept([5, 900, 77]) == 3  # free: anything goes
    assert not state.binding and not state.fill_mask(bitmask, 0) and (bitmask == -1).all()
    assert state.accept([trigger]) == 1 and state.binding
    assert state.fill_mask(bitmask, 0) and not unpack_bitmask(bitmask, VOCAB)[0, 900]
    state.rollback(2)  # back across the trigger: free again
    assert not state.binding and state.num_accepted == 2
    doc = _ids(tok, '{"code": "AB-12"}')
    assert state.accept([77, trigger] + doc + [EOS]) == len(doc) + 3 and state.terminated


# -- the mask in the sampler -----------------------------------------------------------------------------------

def _random_mask(rows: int, vocab: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    words = torch.randint(-2**31, 2**31 - 1, (rows, (vocab + 31) // 32), generator=g, dtype=torch.int64)
    return words.to(torch.int32)


def test_token_mask_reference():
    vocab = 1000  # not a multiple of 32: the last word's high bits are padding
    logits = torch.randn(5, vocab)
    bitmask = _random_mask(2, vocab)
    rows = torch.tensor([3, 1])
    out = apply_token_mask(logits.clone(), TokenMask(bitmask, rows))
    for i, r in enumerate(rows.tolist()):
        for v in range(vocab):
            allowed = (int(bitmask[i, v // 32]) >> (v % 32)) & 1
            assert out[r, v].item() == (logits[r, v].item() if allowed else float("-inf"))
    assert torch.equal(out[[0, 2, 4]], logits[[0, 2, 4]])  # unconstrained rows untouched
    with pytest.raises(ValueError, match="covers 992 tokens"):
        apply_token_mask(logits, TokenMask(bitmask[:, :31], rows))


@pytest.fixture(scope="module")
def triton_mask():
    from triton_interp import import_kernels_interpreted

    if not import_kernels_interpreted():
        pytest.skip("compiled Triton is loaded in this process (GPU runs: tests/gpu/test_structured_gpu.py)")
    from minidsa.common.sampling import token_mask_for

    return token_mask_for("triton")


def test_token_mask_kernel_matches_the_reference(triton_mask):
    """Several kernel blocks and a ragged tail, fp32 and bf16 logits, a row subset in any order, a row stride."""
    vocab = 5000
    bitmask = _random_mask(3, vocab, seed=1)
    rows = torch.tensor([4, 0, 2])
    x = torch.randn(5, vocab)
    for logits in (x, x.bfloat16(), torch.cat([x, x], dim=1)[:, 7:7 + vocab]):
        ref = apply_token_mask(logits.clone(), TokenMask(bitmask, rows))
        got = logits.clone() if logits.is_contiguous() else logits
        triton_mask(got, TokenMask(bitmask, rows))
        assert torch.equal(got, ref)


def test_the_sampler_never_picks_a_masked_token():
    """Greedy and sampled rows take only allowed tokens; their logprobs are of the masked distribution (vLLM's
    choice); an unconstrained row in the same batch samples what it samples alone."""
    vocab, n = 3000, 64
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(n + 1, vocab, generator=g) * 3
    bitmask = _random_mask(n, vocab, seed=2) & _random_mask(n, vocab, seed=5)  # about a quarter allowed
    allowed = unpack_bitmask(bitmask, vocab)
    params = [SamplingParams(temperature=0.0 if i % 4 == 0 else 1.0, seed=i, logprobs=True, top_logprobs=3,
                             top_k=50 if i % 4 == 1 else 0).validate() for i in range(n + 1)]
    sampler = Sampler(vocab, "cpu")
    mask = TokenMask(bitmask, torch.arange(n))
    out = sampler(logits.clone(), params, list(range(n + 1)), mask=mask)
    ids = out.ids[:n]
    assert allowed[torch.arange(n), ids].all()
    greedy = torch.arange(n) % 4 == 0
    best_allowed = logits[:n].masked_fill(~allowed, float("-inf")).argmax(-1)
    assert torch.equal(ids[greedy], best_allowed[greedy]) and not torch.equal(best_allowed, logits[:n].argmax(-1))
    masked = torch.log_softmax(logits[:n].masked_fill(~allowed, float("-inf")), -1)
    assert torch.allclose(out.logprobs[:n], masked.gather(1, ids[:, None]).squeeze(1), atol=1e-5)
    assert allowed.gather(1, out.top_ids[:n]).all()
    alone = sampler(logits[n:].clone(), params[n:], [n])
    assert out.ids[n] == alone.ids[0] and out.logprobs[n] == pytest.approx(alone.logprobs[0].item(), abs=1e-6)


FLOOR_SEED, FLOOR_TOKEN = 242, 122666  # this seed's first key draws the noise floor at this vocab id


def test_a_masked_token_loses_the_race_at_the_noise_floor():
    """The entry whose uniform rounds to 1 in fp32 gets the floor, not 0: -log(0) made its score +inf (it won
    whatever its logit) and a masked -inf logit NaN (argmax picked it)."""
    key = row_key(FLOOR_SEED, 0)
    noise = exponential_noise(torch.tensor([as_int64(key)]), VOCAB)[0]
    assert noise[FLOOR_TOKEN].item() == NOISE_FLOOR == pytest.approx(exponential_noise_reference(key, FLOOR_TOKEN))
    logits = torch.zeros(1, VOCAB)
    logits[0, FLOOR_TOKEN] = float("-inf")
    params = [SamplingParams(temperature=1.0, seed=FLOOR_SEED).validate()]
    assert Sampler(VOCAB, "cpu")(logits.clone(), params, [0]).ids.item() != FLOOR_TOKEN
    logits[0, FLOOR_TOKEN] = -50.0  # a finite but hopeless logit no longer wins either
    assert Sampler(VOCAB, "cpu")(logits.clone(), params, [0]).ids.item() != FLOOR_TOKEN


def test_the_one_pass_race_keeps_the_noise_floor(triton_mask):
    from minidsa.common.sampling import race_argmax, race_for

    logits = torch.zeros(2, VOCAB)
    logits[:, FLOOR_TOKEN] = float("-inf")
    keys = torch.tensor([as_int64(row_key(FLOOR_SEED, 0))] * 2)
    args = (logits, torch.ones(2), keys, torch.tensor([False, True]))
    ids = race_for("triton")(*args)
    assert torch.equal(ids, race_argmax(*args)) and FLOOR_TOKEN not in ids.tolist()


# -- the engine ------------------------------------------------------------------------------------------------

def _requests() -> list[tuple[object, SamplingParams]]:
    """Every bounded schema, greedy and sampled, across two prompts; some ignore eos (the grammar still ends them)."""
    reqs = []
    for i, schema in enumerate(GENERATED.values()):
        for temperature in (0.0, 1.0):
            reqs.append((PROMPTS[i % 2], SamplingParams(max_tokens=MAX_TOKENS, temperature=temperature, seed=i,
                                                        ignore_eos=i % 2 == 1, response_format=json_schema(schema))))
    return reqs


def _check_answer(out, schema) -> None:
    assert out.finish_reason == "stop" and out.token_ids[-1] == EOS, (out.finish_reason, out.text)
    check_against(json.loads(out.text), schema)


@pytest.fixture(scope="module")
def generated(tiny_llm):
    reqs = _requests()
    outs = tiny_llm.generate([p for p, _ in reqs], [sp for _, sp in reqs])
    tiny_llm.engine.check_no_leaks()
    return reqs, outs


def test_answers_follow_each_schema_greedy_and_sampled(generated):
    reqs, outs = generated
    for (_, params), out in zip(reqs, outs):
        _check_answer(out, params.response_format["json_schema"]["schema"])
    assert len({o.text for o in outs}) > len(GENERATED)  # some sampled answer is not its schema's greedy one


def test_a_streamed_answer_is_the_generated_answer(tiny_llm, generated):
    reqs, outs = generated
    (prompt, params), want = reqs[1], outs[1]  # the sampled PERSON answer
    chunks = list(tiny_llm.stream(prompt, params))
    assert "".join(c.new_text for c in chunks) == chunks[-1].text == want.text
    assert [t for c in chunks for t in c.new_token_ids] == want.token_ids and chunks[-1].finish_reason == "stop"


def test_overlap_off_and_prefix_cache_hits_give_the_same_answers(tiny_llm, generated):
    reqs, outs = generated
    engine = Engine(device="cpu", dtype="float32", progress=False, overlap_schedule=False)
    assert not engine.overlap
    ids = [engine.add_request(p, sp) for p, sp in reqs]
    final = {}
    while engine.has_unfinished():
        for o in engine.step():
            final[o.request_id] = o
    assert [final[i].token_ids for i in ids] == [o.token_ids for o in outs]
    engine.check_no_leaks()
    # the shared engine again: its first round cached the prompts; masks only touch sampling
    hits = tiny_llm.engine.metrics().prefix_cache_hit_tokens_total
    again = tiny_llm.generate([p for p, _ in reqs[:2]], [sp for _, sp in reqs[:2]])
    assert tiny_llm.engine.metrics().prefix_cache_hit_tokens_total > hits
    assert [o.token_ids for o in again] == [o.token_ids for o in outs[:2]]


def test_json_object_answers_are_json_objects_as_far_as_they_go(tiny_llm):
    params = [SamplingParams(max_tokens=24, temperature=t, seed=s, response_format={"type": "json_object"})
              for t, s in ((0.0, 0), (1.0, 1), (1.0, 2))]
    free = SamplingParams(max_tokens=24, temperature=1.0, seed=1)
    outs = tiny_llm.generate([PROMPTS[0]] * 4, params + [free])
    for out in outs[:3]:
        assert out.text.startswith("{") and is_json_prefix(out.text), out.text
        if out.finish_reason == "stop":
            assert isinstance(json.loads(out.text), dict)
    assert not is_json_prefix(outs[3].text)  # the check can fail: the same model unconstrained writes no JSON


def test_unconstrained_requests_are_unchanged_beside_constrained_ones(tiny_llm):
    plain = [SamplingParams(max_tokens=8, ignore_eos=True), SamplingParams(max_tokens=8, temperature=1.0, seed=4)]
    alone = tiny_llm.generate([PROMPTS[0], PROMPTS[1]], plain)
    constrained = [SamplingParams(max_tokens=MAX_TOKENS, response_format=json_schema(CODE)),
                   SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=9, response_format=json_schema(PERSON))]
    both = tiny_llm.generate([PROMPTS[1], PROMPTS[0], PROMPTS[1], PROMPTS[0]],
                             [constrained[0]] + plain + [constrained[1]])
    assert [o.token_ids for o in both[1:3]] == [o.token_ids for o in alone]
    _check_answer(both[0], CODE)
    _check_answer(both[3], PERSON)


def test_the_grammar_binds_after_structured_after_token_id(tiny_llm, tok):
    free = tiny_llm.generate([PROMPTS[0]], SamplingParams(max_tokens=5, ignore_eos=True))[0].token_ids
    k = next(i for i in range(1, 5) if free[i] not in free[:i] + [EOS])  # the trigger's first occurrence
    params = SamplingParams(max_tokens=k + 1 + MAX_TOKENS, response_format=json_schema(CODE),
                            structured_after_token_id=free[k])
    out = tiny_llm.generate([PROMPTS[0]], params)[0]
    assert out.token_ids[:k + 1] == free[:k + 1]  # free until the trigger: the model's own greedy tokens
    assert out.finish_reason == "stop" and out.token_ids[-1] == EOS
    check_against(json.loads(tok.decode(out.token_ids[k + 1:])), CODE)


def test_aborting_a_constrained_request_mid_flight(tiny_llm):
    engine = tiny_llm.engine
    keep = engine.add_request(PROMPTS[0], SamplingParams(max_tokens=MAX_TOKENS, response_format=json_schema(NESTED)))
    drop = engine.add_request(PROMPTS[1], SamplingParams(max_tokens=MAX_TOKENS, response_format=json_schema(PERSON)))
    final = {}
    for _ in range(3):
        for o in engine.step():
            final[o.request_id] = o
    assert engine.abort(drop)
    while engine.has_unfinished():
        for o in engine.step():
            final[o.request_id] = o
    assert final[drop].finish_reason == "abort"
    _check_answer(final[keep], NESTED)
    engine.check_no_leaks()


def test_a_token_outside_the_grammar_ends_only_its_request(tiny_llm):
    """Were a mask wrong (here: every token allowed, by a test-side stand-in for the worker's sampling call),
    the grammar would refuse the token: that request ends (abort), its KV is freed, the others go on."""
    engine = tiny_llm.engine
    launch_sampling = engine.worker.launch_sampling
    broken = {}

    def allow_everything_for(pending, bitmask):
        for i, b in enumerate(pending.plan.grammar_rows):
            if pending.plan.request_ids[b] in broken:
                bitmask[i] = -1
        launch_sampling(pending, bitmask)

    engine.worker.launch_sampling = allow_everything_for
    try:
        bad = engine.add_request(PROMPTS[0], SamplingParams(max_tokens=MAX_TOKENS, response_format=json_schema(CODE)))
        good = engine.add_request(PROMPTS[1], SamplingParams(max_tokens=MAX_TOKENS, response_format=json_schema(CODE)))
        plain = engine.add_request(PROMPTS[0], SamplingParams(max_tokens=6, ignore_eos=True))
        broken[bad] = True
        final = {}
        while engine.has_unfinished():
            for o in engine.step():
                final[o.request_id] = o
    finally:
        del engine.worker.launch_sampling
    assert final[bad].finish_reason == "abort" and len(final[bad].token_ids) < MAX_TOKENS
    _check_answer(final[good], CODE)
    assert final[plain].finish_reason == "length" and len(final[plain].token_ids) == 6
    engine.check_no_leaks()


@pytest.mark.parametrize("params, message", [
    (SamplingParams(response_format={"type": "yaml"}), "type 'yaml' is not supported"),
    (SamplingParams(response_format=json_schema({"type": "strnig"})), "the schema cannot be used"),
    (SamplingParams(response_format=json_schema(CODE), structured_after_token_id=VOCAB),
     "structured_after_token_id must be a token id"),
])
def test_bad_structured_requests_are_refused_and_change_nothing(tiny_llm, params, message):
    engine = tiny_llm.engine
    before = (dict(engine.requests), engine.num_waiting(), engine.num_running())
    with pytest.raises(InvalidRequest, match=message):
        engine.add_request(PROMPTS[0], params)
    assert (dict(engine.requests), engine.num_waiting(), engine.num_running()) == before


def test_without_xgrammar_structured_requests_get_a_clear_error(monkeypatch):
    engine = Engine(device="cpu", dtype="float32", progress=False, max_total_tokens=512)
    monkeypatch.setitem(sys.modules, "xgrammar", None)  # `import xgrammar` raises ImportError
    with pytest.raises(InvalidRequest, match=r"^structured outputs need xgrammar \(pip install xgrammar\)"):
        engine.add_request(PROMPTS[0], SamplingParams(response_format={"type": "json_object"}))
    assert not engine.requests
    rid = engine.add_request(PROMPTS[0], SamplingParams(max_tokens=2, response_format={"type": "text"}))
    tokens = []
    while engine.has_unfinished():
        tokens += [t for o in engine.step() if o.request_id == rid for t in o.new_token_ids]
    assert len(tokens) == 2  # unconstrained requests need no xgrammar


@pytest.mark.parametrize("spec", [dict(speculative_num_steps=2),
                                  dict(speculative_num_steps=2, speculative_topk=2, speculative_num_draft_tokens=4,
                                       page_size=1)], ids=["chain", "tree"])
def test_a_speculative_engine_serves_structured_outputs(tiny_llm, spec):
    """A constrained request takes no draft in a speculative round: its token is sampled from the verify's first
    position under its mask, as plain decoding would (the same answers as the plain engine's); unconstrained
    requests in the same rounds keep speculating, token for token what they give alone."""
    engine = Engine(device="cpu", dtype="float32", progress=False, max_total_tokens=4096, **spec)
    assert engine.speculator is not None
    reqs = _requests()[:4]
    plain_params = [SamplingParams(max_tokens=12, ignore_eos=True), SamplingParams(max_tokens=12, ignore_eos=True)]
    alone = [engine.add_request(PROMPTS[i], sp) for i, sp in enumerate(plain_params)]
    final = {}
    while engine.has_unfinished():
        for o in engine.step():
            final[o.request_id] = o
    alone_tokens = [final[i].token_ids for i in alone]
    ids = [engine.add_request(p, sp) for p, sp in reqs] + \
        [engine.add_request(PROMPTS[i], sp) for i, sp in enumerate(plain_params)]
    while engine.has_unfinished():
        for o in engine.step():
            final[o.request_id] = o
    want = tiny_llm.generate([p for p, _ in reqs], [sp for _, sp in reqs])
    for (_, params), rid, w in zip(reqs, ids, want):
        _check_answer(final[rid], params.response_format["json_schema"]["schema"])
        if params.greedy:  # a constrained request decodes as it would without speculation
            assert final[rid].token_ids == w.token_ids
    assert [final[i].token_ids for i in ids[len(reqs):]] == alone_tokens
    assert engine.speculator.stats.verify_steps > 0
    engine.check_no_leaks()


def test_tensor_parallel_ranks_sample_with_rank_0s_masks(tiny_llm):
    """Only rank 0 holds the grammars; rank 1 samples with the bitmask rank 0 broadcasts. Had it sampled without
    it, its next inputs, and so the ranks' joint forward, would part from the one-process tokens."""
    reqs = [(PROMPTS[0], SamplingParams(max_tokens=MAX_TOKENS, response_format=json_schema(PERSON))),
            (PROMPTS[1], SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=3,
                                        response_format=json_schema(NESTED))),
            (PROMPTS[1], SamplingParams(max_tokens=12, ignore_eos=True))]
    want = tiny_llm.generate([p for p, _ in reqs], [sp for _, sp in reqs])
    with LLM(tensor_parallel_size=2, device="cpu", dtype="float32", max_total_tokens=2048, max_running_requests=4,
             progress=False) as tp:
        assert tp.engine.overlap
        got = tp.generate([p for p, _ in reqs], [sp for _, sp in reqs])
        tp.engine.check_no_leaks()
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    _check_answer(got[0], PERSON)
    _check_answer(got[1], NESTED)
