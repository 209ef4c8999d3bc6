"""Token sampling: greedy, temperature, top-k, top-p, min-p, per-request seeds.

Everything runs batched on the device; the engine reads the chosen ids back
once per step (one host sync per step, not per token or per request).

Sampling uses the exponential race: with E_v ~ Exp(1) i.i.d.,
`argmax_v(p_v / E_v)` is a sample from p; it is computed in log space,
`argmax_v(x_v / T - log E_v)` (`race_argmax`; one Triton pass on the GPU).
The noise is not drawn from a
stateful generator but computed by hashing (row key, vocab id), where the
row key is derived from (request seed, output position). So a seeded
request sees the same noise for its n-th token whatever else is in the
batch and after a preemption (CPU and GPU hash the same bits; only the
final log may differ in the last ulp); it also keeps sampling free of
generator state (CUDA-graph friendly). Unseeded rows take a fresh
key from the engine's host RNG (itself seeded by EngineConfig.seed).

Greedy rows (temperature 0) take the exact argmax of the raw logits.

Grammar masks (structured outputs, minidsa/chat/grammar.py) come as a packed bitmask per constrained row
(`TokenMask`: int32 words, bit j of word w allows token 32 * w + j). They are applied to the logits first, in
place, so nothing else can pick a disallowed token: greedy, the race, the filters and the logprobs all see the
masked logits. Reported logprobs are therefore those of the grammar-masked distribution (disallowed tokens at
-inf, the rest renormalised), before temperature and penalties: what vLLM reports, since it masks the logits
before its sampler computes them.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import NamedTuple

import torch

from minidsa.common.batch import host_to_device
from minidsa.common.request import SamplingParams

_M32 = 0xFFFFFFFF
_M64 = 0xFFFFFFFFFFFFFFFF
_GOLDEN32 = 0x9E3779B1
_GOLDEN64 = 0x9E3779B97F4A7C15


def splitmix64(x: int) -> int:
    x = (x + _GOLDEN64) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def row_key(seed: int, position: int) -> int:
    """64-bit noise key of output position `position` of a request seeded with `seed`."""
    return splitmix64(splitmix64(seed & _M64) ^ ((position * _GOLDEN64) & _M64))


def as_int64(key: int) -> int:
    """An unsigned 64-bit key as the int64 (two's complement) a tensor holds."""
    return key - (1 << 64) if key >= (1 << 63) else key


def _i32(c: int) -> int:
    """A 32-bit constant as the signed int32 value with the same bits."""
    return c - (1 << 32) if c >= (1 << 31) else c


def _fmix32(h: torch.Tensor) -> torch.Tensor:
    """murmur3's 32-bit finaliser on int32 tensors (wrapping multiply; masks make the shifts logical).

    A bijection that mixes every input bit into every output bit; the same bits on CPU and GPU.
    """
    h = h ^ ((h >> 16) & 0xFFFF)
    h = h * _i32(0x85EBCA6B)
    h = h ^ ((h >> 13) & 0x7FFFF)
    h = h * _i32(0xC2B2AE35)
    return h ^ ((h >> 16) & 0xFFFF)


NOISE_FLOOR = 2.0**-25  # the smallest Exp(1) noise: -log(1 - 2^-25), rounded


def exponential_noise(keys: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Exp(1) noise [B, V] fp32, a pure function of (keys [B] int64 64-bit key, vocab id).

    h = fmix32((v * golden + key_lo) ^ key_hi): distinct vocab ids of a row hash distinct inputs, and two
    rows share inputs only if both key halves line up (odds ~2^-32).
    """
    key_lo = (keys & _M32).to(torch.int32).unsqueeze(1)  # int64 -> int32 keeps the low 32 bits
    key_hi = ((keys >> 32) & _M32).to(torch.int32).unsqueeze(1)
    cols = torch.arange(vocab_size, dtype=torch.int32, device=keys.device) * _i32(_GOLDEN32)
    h = _fmix32((cols.unsqueeze(0) + key_lo) ^ key_hi)
    u = ((h >> 8) & 0xFFFFFF).to(torch.float32) * (2.0**-24) + 2.0**-25
    # The top bucket's 1 - 2^-25 rounds to 1.0 in fp32 (once in 2^24 entries: ~0.8% of rows at vocab 129280), and
    # -log(1) = 0 would win any race (+inf) and turn a -inf logit (a grammar-masked token) into NaN, which argmax
    # picks. The floor is that bucket's value, as the float64 reference computes it.
    return torch.clamp_min(-torch.log(u), NOISE_FLOOR)


def uniforms(keys: torch.Tensor) -> torch.Tensor:
    """One U(0, 1) draw per key [B] fp32: exp(-E) of the key's noise at vocab id 0 (E ~ Exp(1)). Callers that also
    race on the same key pass a salted key, so the two draws are independent."""
    return torch.exp(-exponential_noise(keys, 1)[:, 0])


def exponential_noise_reference(key: int, vocab_id: int) -> float:
    """Pure-Python value of exponential_noise for one entry (pins the bit-exact definition in tests)."""
    def mul(a: int, b: int) -> int:
        return (a * b) & _M32

    h = ((mul(vocab_id, _GOLDEN32) + (key & _M32)) & _M32) ^ ((key >> 32) & _M32)
    h ^= h >> 16
    h = mul(h, 0x85EBCA6B)
    h ^= h >> 13
    h = mul(h, 0xC2B2AE35)
    h ^= h >> 16
    u = float(h >> 8) * 2.0**-24 + 2.0**-25
    return -math.log(u)


@dataclass
class SamplingBatch:
    """Per-row sampling parameters as device tensors, plus host flags that skip unused stages."""

    temperature: torch.Tensor  # [B] fp32, 1 on greedy rows (unused there)
    greedy: torch.Tensor  # [B] bool
    top_k: torch.Tensor  # [B] int64, vocab size where off
    top_p: torch.Tensor  # [B] fp32
    min_p: torch.Tensor  # [B] fp32
    keys: torch.Tensor  # [B] int64 noise keys (64-bit, two's complement)
    all_greedy: bool
    use_top_k: bool
    max_top_k: int  # largest enabled top-k (sizes torch.topk without a device sync)
    use_top_p: bool
    use_min_p: bool
    want_logprobs: bool

    @classmethod
    def build(cls, params: list[SamplingParams], positions: list[int], rng: random.Random, vocab_size: int,
              device: torch.device | str) -> "SamplingBatch":
        """One row per (params, output position). Unseeded sampling rows draw their key from `rng`."""
        assert len(params) == len(positions)
        keys = []
        for p, pos in zip(params, positions):
            if p.greedy:
                keys.append(0)
            elif p.seed is not None:
                keys.append(row_key(p.seed, pos))
            else:
                keys.append(rng.getrandbits(64))
        keys = [as_int64(k) for k in keys]
        top_k = [p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in params]
        sampling = [p for p in params if not p.greedy]

        def dev(values: list, dtype: torch.dtype) -> torch.Tensor:  # no host sync with the device's queue
            return host_to_device(torch.tensor(values, dtype=dtype), device)

        return cls(
            temperature=dev([p.temperature if not p.greedy else 1.0 for p in params], torch.float32),
            greedy=dev([p.greedy for p in params], torch.bool),
            top_k=dev(top_k, torch.int64),
            top_p=dev([p.top_p for p in params], torch.float32),
            min_p=dev([p.min_p for p in params], torch.float32),
            keys=dev(keys, torch.int64),
            all_greedy=not sampling,
            use_top_k=any(0 < p.top_k < vocab_size for p in sampling),
            max_top_k=max([p.top_k for p in sampling if 0 < p.top_k < vocab_size], default=0),
            use_top_p=any(p.top_p < 1.0 for p in sampling),
            use_min_p=any(p.min_p > 0.0 for p in sampling),
            want_logprobs=any(p.logprobs for p in params),
        )


class TokenMask(NamedTuple):
    """Grammar masks for some rows of a step's logits: bit v % 32 of word v // 32 of bitmask[i] allows token v in
    logits row rows[i]."""

    bitmask: torch.Tensor  # [N, ceil(V / 32)] int32, on the logits' device
    rows: torch.Tensor  # [N] int64, rows of the logits


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """bool [N, vocab_size]: which tokens each row of a packed bitmask allows."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    return ((bitmask.unsqueeze(-1) >> shifts) & 1).bool().flatten(1)[:, :vocab_size]


def apply_token_mask(logits: torch.Tensor, mask: TokenMask) -> torch.Tensor:
    """In place: the logits of disallowed tokens become -inf (the torch reference of
    `kernels/sampling.apply_token_mask`, one pass on the GPU). Returns `logits`."""
    vocab = logits.shape[1]
    if mask.bitmask.shape[1] * 32 < vocab:
        raise ValueError(f"a bitmask of {mask.bitmask.shape[1]} words covers {mask.bitmask.shape[1] * 32} tokens, "
                         f"the logits have {vocab}")
    rows = logits[mask.rows]
    logits[mask.rows] = rows.masked_fill(~unpack_bitmask(mask.bitmask, vocab), float("-inf"))
    return logits


def filtered_logits(logits: torch.Tensor, sb: SamplingBatch) -> torch.Tensor:
    """Logits / temperature with tokens outside top-k, top-p and min-p set to -inf (rows keep >= 1 token)."""
    x = logits.float() / sb.temperature.unsqueeze(1)
    if sb.use_top_p:
        # One descending sort serves top-k and top-p: rank < k, and the mass before a token < p.
        vocab = x.shape[1]
        sorted_x, order = x.sort(dim=-1, descending=True)
        ranks = torch.arange(vocab, device=x.device).unsqueeze(0)
        keep = ranks < sb.top_k.unsqueeze(1)
        sorted_x = sorted_x.masked_fill(~keep, float("-inf"))
        probs = sorted_x.softmax(dim=-1)
        keep &= (probs.cumsum(dim=-1) - probs) < sb.top_p.unsqueeze(1)
        mask = torch.zeros_like(keep).scatter_(1, order, keep)
        x = x.masked_fill(~mask, float("-inf"))
    elif sb.use_top_k:
        vocab = x.shape[1]
        kth = x.topk(sb.max_top_k, dim=-1).values.gather(1, (sb.top_k - 1).clamp(max=sb.max_top_k - 1).unsqueeze(1))
        kth = kth.masked_fill(sb.top_k.unsqueeze(1) >= vocab, float("-inf"))  # rows without top-k keep all
        x = x.masked_fill(x < kth, float("-inf"))
    if sb.use_min_p:
        probs = x.softmax(dim=-1)
        floor = probs.amax(dim=-1, keepdim=True) * sb.min_p.unsqueeze(1)
        x = x.masked_fill(probs < floor, float("-inf"))
    return x


def probabilities(logits: torch.Tensor, sb: SamplingBatch) -> torch.Tensor:
    """The distribution each sampling row draws from (after temperature and filters), [B, V] fp32."""
    return filtered_logits(logits, sb).softmax(dim=-1)


def race_scores(x: torch.Tensor, temperature: torch.Tensor, keys: torch.Tensor, greedy: torch.Tensor
                ) -> torch.Tensor:
    """The exponential race in log space, [B, V] fp32: x on greedy rows, x / temperature - log(E) on the others.

    argmax_v p_v / E_v = argmax_v (log p_v - log E_v), and log p_v is x_v / T up to a constant of the row, so no
    softmax is needed.
    """
    x = x.float()
    scores = x / temperature.unsqueeze(1) - torch.log(exponential_noise(keys, x.shape[1]))
    return torch.where(greedy.unsqueeze(1), x, scores)


def race_argmax(x: torch.Tensor, temperature: torch.Tensor, keys: torch.Tensor, greedy: torch.Tensor
                ) -> torch.Tensor:
    """The winner of each row's race: the torch reference of `kernels/sampling.race_argmax` (one GPU pass)."""
    return race_scores(x, temperature, keys, greedy).argmax(dim=-1)


RACES = ("torch", "triton")


def _by_impl(impl: str, triton_name: str, reference):
    """`reference`, or its one-pass kernel in kernels/sampling.py (importing it imports Triton: GPU or interpreter)."""
    if impl == "triton":
        from minidsa.kernels import sampling as triton_sampling

        return getattr(triton_sampling, triton_name)
    if impl != "torch":
        raise ValueError(f"sampler implementation {impl!r}, want one of {RACES}")
    return reference


def race_for(impl: str):
    """The race implementation named by the kernel choice (`KernelChoice.sample`)."""
    return _by_impl(impl, "race_argmax", race_argmax)


def token_mask_for(impl: str):
    """The grammar-mask implementation of the same kernel choice as `race_for`."""
    return _by_impl(impl, "apply_token_mask", apply_token_mask)


def sample(logits: torch.Tensor, sb: SamplingBatch, race=race_argmax) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Token ids [B] int64 (on device) and, if any row asked, log-probs [B] of the chosen ids under the model."""
    if sb.all_greedy:
        ids = logits.argmax(dim=-1)
    elif sb.use_top_k or sb.use_top_p or sb.use_min_p:
        # Filters keep each row's likeliest token, so a greedy row's argmax is unchanged by them.
        ids = race(filtered_logits(logits, sb), torch.ones_like(sb.temperature), sb.keys, sb.greedy)
    else:
        ids = race(logits, sb.temperature, sb.keys, sb.greedy)
    logprobs = None
    if sb.want_logprobs:
        logprobs = torch.log_softmax(logits.float(), dim=-1).gather(1, ids.unsqueeze(1)).squeeze(1)
    return ids, logprobs


def apply_penalties(logits: torch.Tensor, params: list[SamplingParams], prompts: list[list[int]],
                    outputs: list[list[int]]) -> torch.Tensor:
    """Logits [B, V] with each row's repetition, frequency and presence penalties applied (a new tensor).

    repetition_penalty r (vLLM / SGLang, from CTRL): the logit of every token seen in the prompt or the output
    is divided by r where positive, multiplied by r where negative. Then OpenAI's penalties over the output:
    logit -= frequency_penalty * count + presence_penalty * (count > 0).
    """
    b, vocab = logits.shape
    device = logits.device
    rows = torch.tensor([i for i, o in enumerate(outputs) for _ in o], dtype=torch.int64, device=device)
    ids = torch.tensor([t for o in outputs for t in o], dtype=torch.int64, device=device)
    counts = torch.zeros(b, vocab, dtype=torch.float32, device=device)
    counts.index_put_((rows, ids), torch.ones_like(ids, dtype=torch.float32), accumulate=True)
    x = logits.float().clone()
    rep = torch.tensor([p.repetition_penalty for p in params], dtype=torch.float32, device=device).unsqueeze(1)
    if any(p.repetition_penalty != 1.0 for p in params):
        seen = counts > 0
        p_rows = torch.tensor([i for i, q in enumerate(prompts) for _ in q], dtype=torch.int64, device=device)
        p_ids = torch.tensor([t for q in prompts for t in q], dtype=torch.int64, device=device)
        seen[p_rows, p_ids] = True
        x = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)
    freq = torch.tensor([p.frequency_penalty for p in params], dtype=torch.float32, device=device).unsqueeze(1)
    pres = torch.tensor([p.presence_penalty for p in params], dtype=torch.float32, device=device).unsqueeze(1)
    return x - freq * counts - pres * (counts > 0).float()


class SampledTokens(NamedTuple):
    ids: torch.Tensor  # [B] int64
    logprobs: torch.Tensor | None  # [B] fp32 logprob of each chosen id under the model, if any row asked
    top_ids: torch.Tensor | None  # [B, K] the K likeliest ids (K = the largest top_logprobs asked), if any
    top_logprobs: torch.Tensor | None  # [B, K] their logprobs


class Sampler:
    """Holds the host RNG for unseeded rows; the engine and the speculator sample through it."""

    def __init__(self, vocab_size: int, device: torch.device | str, seed: int = 0, race=race_argmax,
                 mask=apply_token_mask):
        self.vocab_size = vocab_size
        self.race = race  # race_argmax or its one-pass kernel (race_for(KernelChoice.sample))
        self.apply_mask = mask  # apply_token_mask or its one-pass kernel (token_mask_for(KernelChoice.sample))
        self.device = torch.device(device)
        self.rng = random.Random(seed)

    def batch(self, params: list[SamplingParams], positions: list[int]) -> SamplingBatch:
        return SamplingBatch.build(params, positions, self.rng, self.vocab_size, self.device)

    def __call__(self, logits: torch.Tensor, params: list[SamplingParams], positions: list[int],
                 prompts: list[list[int]] | None = None, outputs: list[list[int]] | None = None,
                 mask: TokenMask | None = None) -> SampledTokens:
        """Sample one token per row. Penalties (rows that set them) need each row's prompt and output ids;
        they change what is sampled, not the reported logprobs (those stay the model's own). `mask`: grammar
        masks of some rows, applied to `logits` in place before anything else (those rows' logprobs are then the
        masked distribution's)."""
        if mask is not None and mask.rows.numel():
            self.apply_mask(logits, mask)
        if all(p.greedy and not p.logprobs and not p.penalised for p in params):  # the common case: no tensors
            return SampledTokens(logits.argmax(dim=-1), None, None, None)
        raw = logits
        if any(p.penalised for p in params):
            if prompts is None or outputs is None:
                raise ValueError("penalties need the prompt and output ids of every row")
            logits = apply_penalties(logits, params, prompts, outputs)
        ids, _ = sample(logits, self.batch(params, positions), self.race)
        if not any(p.logprobs for p in params):
            return SampledTokens(ids, None, None, None)
        logprobs = torch.log_softmax(raw.float(), dim=-1)
        chosen = logprobs.gather(1, ids.unsqueeze(1)).squeeze(1)
        k = max(p.top_logprobs for p in params)
        if k == 0:
            return SampledTokens(ids, chosen, None, None)
        top = logprobs.topk(k, dim=-1)
        return SampledTokens(ids, chosen, top.indices, top.values)
