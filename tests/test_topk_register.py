"""The register top-k select (`topk.topk_slots(method="register")`) against the reference, on CPU through Triton's
interpreter: one program per row, the row held in registers, one launch.

Same set-up as tests/test_kernels.py: the kernels are imported interpreted (or, when a compiled triton was
imported earlier in this process, the file re-runs itself in a child process), and every torch.empty made during
a test comes back poisoned, so an output element the kernel forgets to write fails. Outputs are compared with
`reference.topk_slots` (same positions per row, each slot req_to_token[token_rows[t], pos], -1 padding) and, exactly,
with the one-program-per-row and split kernels (all three write in position order, ties to lower positions).
"""

from __future__ import annotations

import pytest
import torch

if torch.cuda.is_available():
    pytest.skip("CUDA present: tests/gpu/test_kernels_gpu.py checks the compiled kernels", allow_module_level=True)


from triton_interp import (SPILL_CHECK, compile_for_h100, import_kernels_interpreted,  # noqa: E402
                           poison_new_tensors, run_file_interpreted)

INTERPRETED = import_kernels_interpreted()
in_this_process = pytest.mark.skipif(not INTERPRETED, reason="runs in the child process below")

import minidsa.kernels  # noqa: E402
from minidsa.kernels import reference as ref  # noqa: E402
from minidsa.kernels import topk as topk_mod  # noqa: E402


@pytest.mark.skipif(INTERPRETED, reason="kernels are interpreted in this process")
def test_register_topk_in_child_process():
    run_file_interpreted(__file__)


@pytest.fixture(autouse=True)
def poisoned_outputs(monkeypatch):
    """Every torch.empty / empty_like made during a test comes back full of garbage (TRITON_INTERPRET=1 meanwhile)."""
    poison_new_tensors(monkeypatch)


def _case(seed: int, width: int):
    """6 rows of random logits, -inf past each row's visible length (all, none, 3, half, all but one, 17); logits a
    view with a row stride past the width, req_to_token rows wider than the logits, token_rows out of order."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(6, width + 5, generator=g)[:, :width]
    visible = torch.tensor([width, 0, 3, width // 2, width - 1, 17])
    logits[torch.arange(width)[None, :] >= visible[:, None]] = float("-inf")
    r2t = torch.randperm(4 * (width + 7), generator=g)[: 3 * (width + 7)].view(3, width + 7).to(torch.int32)
    rows = torch.tensor([2, 0, 1, 1, 0, 2])
    return logits, r2t, rows


# (RADIX_BITS, EARLY_EXIT) of the register select: the 2-bit search stopping early (the default), all 16 steps, the
# byte histograms (EARLY_EXIT does not apply).
SEARCHES = [(2, True), (2, False), (8, False)]


def _register(logits, k, r2t, rows, search, **kw):
    radix_bits, early_exit = search
    return topk_mod.topk_slots(logits, k, r2t, rows, method="register", register_config=(radix_bits, 4),
                               register_early_exit=early_exit, **kw)


def _check_against_reference(logits, k, r2t, rows, slots, pos):
    want_slots, want_pos = ref.topk_slots(logits, k, r2t, rows)
    assert slots.shape == pos.shape == (logits.shape[0], k) and slots.dtype == pos.dtype == torch.int32
    for t in range(logits.shape[0]):
        assert sorted(pos[t].tolist()) == sorted(want_pos[t].tolist()), t
        assert sorted(slots[t].tolist()) == sorted(want_slots[t].tolist()), t
        ok = pos[t] >= 0
        n = int(ok.sum())
        assert ok[:n].all() and not ok[n:].any()  # the taken positions first, then -1 padding
        assert torch.equal(pos[t][:n], pos[t][:n].sort().values)  # in position order
        assert torch.equal(slots[t][:n], r2t[rows[t], pos[t][:n].long()])
        assert (slots[t][n:] == -1).all()


@in_this_process
@pytest.mark.parametrize("search", SEARCHES)
@pytest.mark.parametrize("width,k", [
    (1, 16), (100, 16), (2047, 16), (2048, 16), (2049, 16), (4096, 16), (5000, 16), (8192, 16),
    (100, 2048), (2047, 2048), (2048, 2048), (2049, 2048), (5000, 2048),  # k > width, = width, just below
])
def test_register_matches_reference(search, width, k):
    logits, r2t, rows = _case(width * 7 + k, width)
    slots, pos = _register(logits, k, r2t, rows, search)
    _check_against_reference(logits, k, r2t, rows, slots, pos)
    rows_slots, rows_pos = topk_mod.topk_slots(logits, k, r2t, rows, method="rows")
    assert torch.equal(pos, rows_pos) and torch.equal(slots, rows_slots)


@in_this_process
@pytest.mark.parametrize("width", [4096, 8192])
def test_register_long_rows_default_config(width):
    """The served shape (k = 2048) at the default RADIX_BITS and warps, one row (the default path on CPU) and 3."""
    for num_rows in (1, 3):
        logits, r2t, rows = _case(width + num_rows, width)
        logits, rows = logits[:num_rows], rows[:num_rows]
        slots, pos = topk_mod.topk_slots(logits, 2048, r2t, rows, method="register")
        _check_against_reference(logits, 2048, r2t, rows, slots, pos)


def test_register_tiles_rule():
    """One power-of-two block, or (P/2, P/8) where the row passes P/2 by at most P/8; few variants at k = 2048."""
    rule = topk_mod.register_tiles_for
    assert rule(4096, 2048) == (4096, 0) and rule(4097, 2048) == (4096, 1024) and rule(4160, 2048) == (4096, 1024)
    assert rule(5120, 2048) == (4096, 1024) and rule(5121, 2048) == (8192, 0) and rule(8192, 2048) == (8192, 0)
    assert rule(100, 2048) == (2048, 0) and rule(2049, 2048) == (2048, 512) and rule(8193, 2048) == (8192, 2048)
    assert rule(1, 16) == (256, 0) and rule(257, 16) == (256, 64)
    variants = {rule(w, 2048) for w in range(1, topk_mod.REGISTER_MAX_BLOCK + 1)}
    assert variants == {(2048, 0), (2048, 512), (4096, 0), (4096, 1024), (8192, 0), (8192, 2048), (16384, 0)}
    for w in range(1, topk_mod.REGISTER_MAX_BLOCK + 1, 37):
        head, tail = rule(w, 2048)
        assert head + tail >= w and head + tail <= topk_mod.REGISTER_MAX_BLOCK


@in_this_process
@pytest.mark.parametrize("search", SEARCHES)
@pytest.mark.parametrize("width,k,tiles", [
    (4160, 2048, None), (5120, 2048, None), (4097, 2048, None),  # the default (4096, 1024) tiles
    (300, 16, (256, 64)), (257, 16, (256, 64)), (256, 16, (256, 64)),  # the tail empty, one lane, full
    (300, 200, (128, 256)), (200, 150, (128, 128)),  # k above HEAD; a tail as wide as the head
    (2100, 2048, (2048, 512)), (3000, 2048, (2048, 2048)),
])
def test_register_two_tiles_match_reference(search, width, k, tiles):
    """Rows held as a HEAD and a TAIL tile: the threshold counted over both, ties across the seam taken from the
    lowest positions, output in position order (positions in the tail after the head's)."""
    logits, r2t, rows = _case(width * 3 + k, width)
    slots, pos = _register(logits, k, r2t, rows, search, register_tiles=tiles)
    _check_against_reference(logits, k, r2t, rows, slots, pos)
    one_slots, one_pos = _register(logits, k, r2t, rows, search,
                                   register_tiles=(max(256, 1 << (max(width, k) - 1).bit_length()), 0))
    assert torch.equal(pos, one_pos) and torch.equal(slots, one_slots)


@in_this_process
@pytest.mark.parametrize("search", SEARCHES)
def test_register_two_tiles_ties_across_the_seam(search):
    """Equal keys on both sides of the HEAD | TAIL seam: the head's are taken first, then the tail's up to k."""
    width, k, head, tail = 300, 100, 256, 64
    logits = torch.full((3, width), float("-inf"))
    logits[0, 200:] = 1.0  # 100 equal values: 56 in the head, 44 in the tail, all taken
    logits[1, 220:] = 1.0  # 80 equal, 36 + 44 ...
    logits[1, :30] = torch.arange(30).float() - 100.0  # ... and 20 of these 30 smaller ones: the largest 20
    logits[2, :20] = 2.0  # 20 above 100 equal ones straddling the seam (200-299): the lowest 80 of those
    logits[2, 200:] = 1.0
    r2t = torch.arange(width, dtype=torch.int32).view(1, width) * 3 + 5
    rows = torch.zeros(3, dtype=torch.long)
    slots, pos = _register(logits, k, r2t, rows, search, register_tiles=(head, tail))
    assert pos[0].tolist() == list(range(200, 300))
    assert pos[1].tolist() == list(range(10, 30)) + list(range(220, 300))
    assert pos[2].tolist() == list(range(20)) + list(range(200, 280))
    assert torch.equal(slots, r2t[0, pos.long()])


@in_this_process
def test_register_tiles_refused_when_they_do_not_hold_the_row():
    logits, r2t, rows = _case(1, 300)
    for tiles in ((256, 32), (256, 48), (200, 128)):  # too narrow; not powers of two
        with pytest.raises(ValueError, match="register tiles"):
            topk_mod.topk_slots(logits, 16, r2t, rows, method="register", register_tiles=tiles)


def _lowest_ties(logits: torch.Tensor, k: int) -> list[list[int]]:
    """Per row: the k largest visible positions, equal values taken from the lowest position up, in position order."""
    out = []
    for row in logits:
        order = torch.sort(row, descending=True, stable=True).indices[:k]
        out.append(sorted(p for p in order.tolist() if row[p] > float("-inf")))
    return out


@in_this_process
@pytest.mark.parametrize("search", SEARCHES)
def test_register_ties_take_lowest_positions(search):
    width, k = 1000, 100
    logits = torch.full((5, width), float("-inf"))
    logits[0, :600] = 1.0  # 600 equal values: the first 100 positions
    logits[1, 500:] = torch.arange(500).float() % 7  # many ties at the threshold value
    logits[2] = 0.5  # every value equal
    logits[3, ::3] = -2.0  # 334 equal negative values above the rest of the row: positions 0, 3, ..., 297
    logits[3, 1::3] = torch.arange(333).float() % 3 - 5.0
    logits[4, :50] = 3.0  # fewer visible than k, all equal: all of them
    r2t = torch.arange(3 * width, dtype=torch.int32).view(3, width) * 2 + 1
    rows = torch.tensor([0, 1, 2, 0, 1])
    slots, pos = _register(logits, k, r2t, rows, search)
    want = _lowest_ties(logits, k)
    assert pos[0].tolist() == list(range(100))
    for t in range(logits.shape[0]):
        n = len(want[t])
        assert pos[t, :n].tolist() == want[t] and (pos[t, n:] == -1).all()
        assert torch.equal(slots[t, :n], r2t[rows[t], pos[t, :n].long()]) and (slots[t, n:] == -1).all()
    for other in (dict(method="rows"), dict(method="split", num_chunks=4, split_block=64)):
        o_slots, o_pos = topk_mod.topk_slots(logits, k, r2t, rows, **other)
        assert torch.equal(pos, o_pos) and torch.equal(slots, o_slots), other


def _search_steps(row: torch.Tensor, k: int) -> tuple[int, bool]:
    """A model of the 2-bit search on one row: (steps run with early exit, whether it stopped on exactly k keys at or
    above the bits fixed). (0, False) with k or fewer visible keys, which skip the search."""
    if int((row > float("-inf")).sum()) <= k:
        return 0, False
    key = row.view(torch.int32).long()
    key = torch.where(key >= 0, key, key ^ 0x7FFFFFFF) + 2 ** 31  # the kernel's orderable key, as an int64
    thr, n_at = 0, row.numel()
    for step in range(16):
        bit = 1 << (30 - 2 * step)
        counts = [int((key >= thr + c * bit).sum()) for c in (1, 2, 3)]
        d = sum(n >= k for n in counts)
        n_at = counts[d - 1] if d else n_at
        thr += d * bit
        if n_at == k:
            return step + 1, True
    return 16, False


@in_this_process
def test_register_early_exit_rows():
    """Rows where the 2-bit search stops early (after 1 step; after ~10 on distinct values, with -inf padding or not),
    at the last step on exactly k keys, or never (ties at the threshold): the same output as all 16 steps and the
    one-program-per-row kernel, the reference's positions where no tie is broken, and ties to the lowest positions."""
    width, k = 4160, 2048  # decode at context 4096: HEAD 4096 + TAIL 1024 tiles
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(6, width, generator=g)
    logits[1] = -1.0  # k equal values alone in the upper half of the key space: one step
    logits[1, torch.randperm(width, generator=g)[:k]] = 1.0
    logits[2, :] -= 10.0  # 2000 distinct values above 100 ties at T: the search never stops early
    logits[2, torch.randperm(width, generator=g)[:2100]] = torch.cat([torch.randn(2000, generator=g) + 10.0,
                                                                       torch.full((100,), 5.0)])
    logits[3, :] -= 10.0  # k - 1 values, then 3.0 + 1 ulp and 3.0: their keys differ in bit 0 only, exactly k at
    logits[3, : k - 1] += 20.0  # or above the larger one: stops at the last step, taking no 3.0
    logits[3, 3000] = torch.nextafter(torch.tensor(3.0), torch.tensor(4.0))
    logits[3, 2500] = 3.0
    logits[4, 3000:] = float("-inf")  # distinct values, 3000 visible
    logits[5] = 0.5  # all equal: the first k positions after 16 steps
    steps = [_search_steps(row, k) for row in logits]
    assert steps[0][1] and steps[0][0] < 14 and steps[4][1] and steps[4][0] < 14, steps
    assert steps[1] == (1, True) and steps[2] == (16, False) and steps[3] == (16, True) and steps[5] == (16, False)
    r2t = torch.randperm(2 * width, generator=g)[:width].view(1, width).to(torch.int32)
    rows = torch.zeros(6, dtype=torch.long)
    slots, pos = _register(logits, k, r2t, rows, (2, True))
    untied = [0, 1, 3, 4]  # no ties to break (the reference's torch.topk breaks them its own way)
    _check_against_reference(logits[untied], k, r2t, rows[untied], slots[untied], pos[untied])
    want = _lowest_ties(logits, k)
    for t in range(logits.shape[0]):
        assert pos[t].tolist() == want[t] + [-1] * (k - len(want[t])), t
    assert 3000 in pos[3].tolist() and 2500 not in pos[3].tolist()
    for other in (dict(register_early_exit=False), dict(method="rows")):
        o_slots, o_pos = topk_mod.topk_slots(logits, k, r2t, rows, **({"method": "register"} | other))
        assert torch.equal(pos, o_pos) and torch.equal(slots, o_slots), other


@in_this_process
def test_default_dispatch_takes_the_register_select(monkeypatch):
    """Rows no wider than REGISTER_FEW_ROWS_MAX_WIDTH (few rows: on CPU, 8 stand-in SMs, one row) or REGISTER_MAX_WIDTH (more rows) take the register select, from
    topk_slots and fastest_topk_slots; num_chunks still forces the split / one-program-per-row kernels."""
    calls = []
    original = topk_mod._register_topk
    monkeypatch.setattr(topk_mod, "_register_topk", lambda *a, **kw: calls.append(a[0].shape) or original(*a, **kw))
    logits, r2t, rows = _case(3, 300)
    one = (logits[:1], 40, r2t, rows[:1])
    want = ref.topk_slots(*one)
    for fn in (topk_mod.topk_slots, topk_mod.fastest_topk_slots):
        slots, pos = fn(*one)
        assert sorted(pos[0].tolist()) == sorted(want[1][0].tolist())
    assert calls == [(1, 300)] * 2
    topk_mod.topk_slots(*one, num_chunks=1)
    topk_mod.topk_slots(*one, num_chunks=3, split_block=64)
    topk_mod.topk_slots(logits, 40, r2t, rows)  # 6 rows (not few on CPU), 300 wide: the register select too
    assert calls[-1] == (6, 300)
    wide = torch.randn(1, topk_mod.REGISTER_FEW_ROWS_MAX_WIDTH + 1)  # one row this wide splits
    topk_mod.topk_slots(wide, 16, torch.zeros(1, wide.shape[1], dtype=torch.int32), torch.zeros(1, dtype=torch.long))
    assert len(calls) == 3


def test_register_select_wins_is_a_pure_size_rule(monkeypatch):
    cpu = torch.device("cpu")  # 8 stand-in SMs: few rows = 1
    assert topk_mod.register_select_wins(1, 4096, cpu)
    assert topk_mod.register_select_wins(1, topk_mod.REGISTER_FEW_ROWS_MAX_WIDTH, cpu)
    assert not topk_mod.register_select_wins(1, topk_mod.REGISTER_FEW_ROWS_MAX_WIDTH + 1, cpu)  # split
    assert topk_mod.register_select_wins(2, topk_mod.REGISTER_MAX_WIDTH, cpu)  # many rows: register up to 16384
    assert not topk_mod.register_select_wins(2, topk_mod.REGISTER_MAX_WIDTH + 1, cpu)
    cuda = torch.device("cuda")  # an H100's 132 SMs: few rows = up to 16
    monkeypatch.setitem(minidsa.kernels._NUM_SMS, cuda, 132)
    assert topk_mod.register_select_wins(16, 4096, cuda) and topk_mod.register_select_wins(17, 4096, cuda)
    assert not topk_mod.register_select_wins(16, 16384, cuda) and topk_mod.register_select_wins(17, 16384, cuda)
    assert topk_mod.REGISTER_MAX_WIDTH <= topk_mod.REGISTER_MAX_BLOCK


def test_register_select_refuses_what_it_cannot_take():
    logits = torch.randn(1, topk_mod.REGISTER_MAX_BLOCK + 1)
    r2t = torch.zeros(1, logits.shape[1], dtype=torch.int32)
    rows = torch.zeros(1, dtype=torch.long)
    with pytest.raises(ValueError, match="register select takes rows up to"):
        topk_mod.topk_slots(logits, 16, r2t, rows, method="register")
    with pytest.raises(ValueError, match="method must be one of"):
        topk_mod.topk_slots(logits, 16, r2t, rows, method="heap")


_COMPILE_FOR_H100 = SPILL_CHECK + """
from minidsa.kernels import topk
sig = {"logits_ptr": "*fp32", "r2t_ptr": "*i32", "rows_ptr": "*i64", "slots_ptr": "*i32", "pos_ptr": "*i32",
       "width": "i32", "k": "i32", "stride_l": "i32", "stride_r2t": "i32", "stride_o": "i32",
       "HEAD": "constexpr", "TAIL": "constexpr", "RADIX_BITS": "constexpr", "EARLY_EXIT": "constexpr",
       "PDL": "constexpr"}
decode = ((4096, 1024), (2048, 512), (8192, 0))  # contexts 4096, 2048, 8192 plus decode tokens; 8 warps each
for head, tail in decode + ((4096, 0), (8192, 2048), (topk.REGISTER_MAX_BLOCK, 0)):
    for bits, early_exit in ((2, True), (2, False), (8, False)):
        src = ASTSource(topk._register_topk_kernel, sig,
                        constexprs={"HEAD": head, "TAIL": tail, "RADIX_BITS": bits, "EARLY_EXIT": early_exit,
                                    "PDL": True})
        num_warps = topk.register_warps(head + tail)
        if (head, tail) in decode and bits == 2:
            assert num_warps == 8
            compile_without_spills(src, num_warps)
        else:
            assert triton.compile(src, target=target, options={"num_warps": num_warps}).asm["cubin"], \
                (head, tail, bits, early_exit)
print("compiled")
"""


def test_register_kernel_compiles_for_h100():
    """The interpreter runs Python, not Triton's compiler: compile the kernel for sm_90 (no GPU needed) so what only
    the compiler refuses (say, a constexpr name bound twice in an unrolled loop) fails here. The decode variants of
    the 2-bit search (both loops) must not spill by ptxas's count (sm_90a): at 4096 + 1024 the unrolled search with
    a tl.sum per tile spilled 8 bytes a thread."""
    compile_for_h100(_COMPILE_FOR_H100, "_register_topk_kernel")
