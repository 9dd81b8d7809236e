"""The grouped prefix-hit operators (hmem/prefix_hit/grouped.py): one C-bit Bitmap per
(group, rank) row, paired 1:1 with a window.  Hand-worked cases, argument errors, and
properties checked against the flat operators on the same cells, against a brute-force
model that applies the definition literally per row, and (the kernels) against their
pure-Python reference twins."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

import hmem
from hmem import (
    FULL_ATTENTION_WINDOW,
    Bitmap,
    InvalidArgumentError,
    Layout,
    explain_prefix_hit,
    fold,
    fold_grouped,
    fold_unfold_grouped,
    fold_unfold_ranked,
    group_rows,
    presence_map,
    unfold,
    unfold_grouped,
    unfold_range,
)
from hmem.kernels._native import _bitops as native
from hmem.kernels.reference import bitops as ref

GM, CM = Layout.GROUP_MAJOR, Layout.CHUNK_MAJOR

# ---- the brute-force model ------------------------------------------------------------


def lo_of(window: int, L: int) -> int:
    return 0 if window <= 0 else max(0, L - window)


def cell(g: int, j: int, r: int, C: int, R: int, G: int, layout: Layout) -> int:
    """Index of group g, chunk j, rank r in a flat presence map (hmem/prefix_hit/operators.py)."""
    return j * G * R + g * R + r if layout is CM else g * C * R + j * R + r


class RowModel:
    """The definition, literally, one row at a time: row i serves length L when it
    holds every chunk of [lo, L) under its window; L is servable when every row
    serves it; the hit is the largest servable L; row i retains [lo, hit)."""

    def __init__(self, rows: list[list[bool]], windows: list[int]) -> None:
        assert rows and len(rows) == len(windows)
        C = len(rows[0])
        assert all(len(r) == C for r in rows)
        self.C = C
        # serves[i][L], L = 0..C
        self.serves = [[L == 0 or all(row[lo_of(w, L) : L]) for L in range(C + 1)] for row, w in zip(rows, windows)]
        self.servable = [all(s[L] for s in self.serves) for L in range(1, C + 1)]
        self.hit = max((L for L in range(1, C + 1) if self.servable[L - 1]), default=0)
        self.retain = [[lo_of(w, self.hit) <= j < self.hit for j in range(C)] for w in windows]
        self.own_hit = [max((L for L in range(1, C + 1) if s[L]), default=0) for s in self.serves]
        self.first_missing = [next((j for j in range(C) if not row[j]), None) for row in rows]
        self.blocks_longer = [self.hit < C and not s[self.hit + 1] for s in self.serves]


def to_bitmap(bits) -> Bitmap:
    return Bitmap.from_numpy(np.asarray(bits, dtype=np.bool_).reshape(-1))


def bits_of(bm: Bitmap) -> list[bool]:
    return bm.to_numpy().tolist()


def packed(bits, extra: bytes = b"", pad_garbage: int = 0) -> bytearray:
    """LSB-first bytes of `bits`, with garbage in the unused bits of the last byte
    (pad_garbage) and `extra` bytes after it: the kernels must read neither."""
    n = len(bits)
    out = bytearray((n + 7) // 8)
    for i, b in enumerate(bits):
        if b:
            out[i >> 3] |= 1 << (i & 7)
    if n % 8:
        out[-1] |= pad_garbage & ~((1 << (n % 8)) - 1) & 0xFF
    return out + extra


def tail_is_clear(bm: Bitmap) -> bool:
    return int.from_bytes(bm.to_bytes(), "little") >> len(bm) == 0


# ---- strategies ---------------------------------------------------------------------------

WINDOWS = st.one_of(
    st.sampled_from([FULL_ATTENTION_WINDOW, 0, -7]),
    st.integers(1, 6),
    st.integers(7, 5000),  # often larger than C
    st.sampled_from([2**62, 2**64, -(2**64)]),  # beyond what a C long holds: the Python layer maps them
)

# What the kernels take directly (C longs): no mapping in front of them.
KERNEL_WINDOWS = st.one_of(st.integers(-8, 0), st.integers(1, 6), st.integers(7, 3000), st.just(2**62))


@st.composite
def row_bits(draw, C: int) -> list[bool]:
    """One row of C presence bits: random, a few holes, long runs, all, none, or only a tail."""
    mode = draw(st.sampled_from(["random", "holes", "runs", "ones", "zeros", "tail"]))
    if mode == "random" and C <= 200:
        return draw(st.lists(st.booleans(), min_size=C, max_size=C))
    if mode == "random":  # too long for a list strategy: seeded noise of some density
        density = draw(st.sampled_from([0.5, 0.99, 0.999]))
        return (np.random.default_rng(draw(st.integers(0, 2**32 - 1))).random(C) < density).tolist()
    if mode == "holes":
        holes = set(draw(st.lists(st.integers(0, max(0, C - 1)), max_size=4))) if C else set()
        return [j not in holes for j in range(C)]
    if mode == "runs":
        bits: list[bool] = []
        value = draw(st.booleans())
        while len(bits) < C:
            run = draw(st.integers(1, max(1, C)))
            bits.extend([value] * min(run, C - len(bits)))
            value = not value
        return bits
    if mode == "ones":
        return [True] * C
    if mode == "zeros":
        return [False] * C
    k = draw(st.integers(0, C))  # only the last k chunks (what a mamba row often holds)
    return [j >= C - k for j in range(C)]


@st.composite
def grouped_cases(draw, max_chunks: int = 40, max_rows: int = 8, windows=WINDOWS):
    """(rows, windows): rows a list of lists of C bools, one window per row."""
    C = draw(st.integers(0, max_chunks))
    n = draw(st.integers(1, max_rows))
    ws = draw(st.lists(windows, min_size=n, max_size=n))
    if draw(st.booleans()):  # ranks of a group: rows with the same window, often the same bits
        rows = [draw(row_bits(C))] * n if draw(st.booleans()) else [draw(row_bits(C)) for _ in range(n)]
    else:
        rows = [draw(row_bits(C)) for _ in range(n)]
    return rows, ws


@st.composite
def flat_cases(draw, max_chunks: int = 24, max_groups: int = 4, max_ranks: int = 3):
    """(C, R, group windows, cube) with cube[g][r] the C bits of (group g, rank r)."""
    G = draw(st.integers(1, max_groups))
    R = draw(st.integers(1, max_ranks))
    C = draw(st.integers(0, max_chunks))
    ws = draw(st.lists(WINDOWS, min_size=G, max_size=G))
    cube = [[draw(row_bits(C)) for _ in range(R)] for _ in range(G)]
    return C, R, ws, cube


def check_against_model(rows_bits: list[list[bool]], windows: list[int]) -> RowModel:
    """Every grouped operator agrees with the brute-force model."""
    m = RowModel(rows_bits, windows)
    C, n = m.C, len(rows_bits)
    rows = [to_bitmap(b) for b in rows_bits]

    servable = fold_grouped(rows, windows)
    assert len(servable) == C and tail_is_clear(servable)
    assert bits_of(servable) == m.servable

    hit, retain = fold_unfold_grouped(rows, windows)
    assert hit == m.hit and 0 <= hit <= C
    assert servable.highest_set_bit() + 1 == hit
    assert isinstance(retain, list) and len(retain) == n
    for i, kept in enumerate(retain):
        assert isinstance(kept, Bitmap) and len(kept) == C and tail_is_clear(kept)
        assert bits_of(kept) == m.retain[i], i
        # a row keeps only chunks it holds, exactly unfold_range(hit, w) of them
        assert (kept & rows[i]) == kept
        assert kept.runs() == ([unfold_range(hit, windows[i])] if hit - lo_of(windows[i], hit) else [])
    assert unfold_grouped(hit, C, windows) == retain
    return m


# ---- hand-worked cases ------------------------------------------------------------------


def test_readme_example_as_rows():
    # 2 groups (full attention, window 2) x 2 ranks, C = 5: group 0 holds
    # {0,1,2,3} on both ranks, group 1 holds {2,3,4}: hit 4.
    C = 5
    a, b = Bitmap.from_indices([0, 1, 2, 3], C), Bitmap.from_indices([2, 3, 4], C)
    rows, windows = [a, a.copy(), b, b.copy()], [-1, -1, 2, 2]
    assert fold_grouped(rows, windows).indices().tolist() == [3]  # only length 4
    hit, retain = fold_unfold_grouped(rows, windows)
    assert hit == 4
    assert [r.indices().tolist() for r in retain] == [[0, 1, 2, 3], [0, 1, 2, 3], [2, 3], [2, 3]]
    # the same answer as the README's flat presence map
    found = presence_map([[a, a], [b, b]], C)
    flat_hit, mask = fold_unfold_ranked(found, C, 2, [FULL_ATTENTION_WINDOW, 2])
    assert flat_hit == hit and mask.indices().tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 14, 15, 16, 17]
    assert [r for g in group_rows(mask, C, 2, [-1, 2]) for r in g] == retain


def test_one_rank_missing_a_chunk_stops_the_prefix():
    # group of 2 ranks, rank 1 lacks chunk 1: only length 1 is servable
    C = 3
    rows = [Bitmap.ones(C), Bitmap.from_indices([0, 2], C)]
    assert fold_unfold_grouped(rows, [-1, -1]) == (1, [Bitmap.prefix(C, 1), Bitmap.prefix(C, 1)])


def test_zero_chunks():
    for windows in ([-1], [-1, 3], [1, 1, 7]):
        rows = [Bitmap(0) for _ in windows]
        assert fold_grouped(rows, windows) == Bitmap(0)
        assert fold_unfold_grouped(rows, windows) == (0, [Bitmap(0)] * len(windows))
        for hit in (0, 7):
            assert unfold_grouped(hit, 0, windows) == [Bitmap(0)] * len(windows)
        report = explain_prefix_hit(rows, windows=windows)
        assert report.hit == 0 and report.num_chunks == 0 and report.limiting_groups == ()
        assert report.retain_rows == (Bitmap(0),) * len(windows) and report.from_rows
        assert all(g.first_missing is None and g.own_hit == 0 and g.needed == (0, 0) for g in report.groups)


def test_all_present():
    C = 6
    windows = [-1, 0, 1, 2, 6, 100]
    rows = [Bitmap.ones(C) for _ in windows]
    assert fold_grouped(rows, windows) == Bitmap.ones(C)
    hit, retain = fold_unfold_grouped(rows, windows)
    assert hit == C
    assert [r.runs() for r in retain] == [[(0, 6)], [(0, 6)], [(5, 6)], [(4, 6)], [(0, 6)], [(0, 6)]]


def test_nothing_present():
    C = 7
    windows = [-1, 1, 3]
    rows = [Bitmap(C) for _ in windows]
    assert fold_grouped(rows, windows) == Bitmap(C)
    assert fold_unfold_grouped(rows, windows) == (0, [Bitmap(C)] * 3)
    # one empty row is enough, whatever its window
    for w in (-1, 1, 3):
        assert fold_unfold_grouped([Bitmap.ones(C), Bitmap(C)], [-1, w])[0] == 0


def test_mamba_row_holding_only_its_last_chunk_does_not_block():
    C = 4
    rows = [Bitmap.ones(C), Bitmap.from_indices([3], C)]
    assert fold_grouped(rows, [-1, 1]).indices().tolist() == [3]
    hit, retain = fold_unfold_grouped(rows, [-1, 1])
    assert hit == 4
    assert [r.indices().tolist() for r in retain] == [[0, 1, 2, 3], [3]]
    # alone, it serves exactly the lengths that end on a chunk it holds
    assert fold_grouped(rows[1:], [1]).indices().tolist() == [3]


def test_window_row_with_a_gap_has_gappy_servable_lengths():
    # window 2 with chunks {0,1,3,4} of 5: servable lengths {1, 2, 5}
    row = Bitmap.from_indices([0, 1, 3, 4], 5)
    assert fold_grouped([row], [2]).indices().tolist() == [0, 1, 4]
    hit, retain = fold_unfold_grouped([row], [2])
    assert hit == 5  # the highest servable length, not the leading ones (2)
    assert retain[0].indices().tolist() == [3, 4]
    # next to a full-attention row that stops at 3, the hit is 2
    hit, retain = fold_unfold_grouped([Bitmap.prefix(5, 3), row], [-1, 2])
    assert hit == 2 and [r.indices().tolist() for r in retain] == [[0, 1], [0, 1]]


def test_window_row_needs_only_its_last_chunks():
    C = 6
    rows = [Bitmap.ones(C), Bitmap.from_indices([4, 5], C)]
    hit, retain = fold_unfold_grouped(rows, [-1, 2])
    assert hit == 6 and retain == rows


@pytest.mark.parametrize("w", [6, 7, 100, 2**40, 2**62, 2**63, 2**64, 10**30])
def test_windows_at_least_c_act_as_full_attention(w):
    C = 6
    row = Bitmap.from_indices([0, 1, 2, 4, 5], C)  # a window of 2 would serve length 6
    assert fold_grouped([row], [w]) == fold_grouped([row], [-1]) == Bitmap.prefix(C, 3)
    assert fold_unfold_grouped([row], [w]) == (3, [Bitmap.prefix(C, 3)])
    assert unfold_grouped(5, C, [w, 2]) == [Bitmap.prefix(C, 5), Bitmap.from_indices([3, 4], C)]
    assert fold_grouped([Bitmap.ones(C), row], [-1, w]) == Bitmap.prefix(C, 3)


@pytest.mark.parametrize("w", [0, -1, -7, FULL_ATTENTION_WINDOW, -(2**63), -(2**64)])
def test_every_window_at_or_below_zero_is_full_attention(w):
    C = 6
    rows = [Bitmap.ones(C), Bitmap.from_indices([0, 1, 3, 4, 5], C)]
    assert fold_grouped(rows, [-1, 2]).indices().tolist() == [0, 1, 4, 5]
    hit, retain = fold_unfold_grouped(rows, [-1, w])
    assert hit == 2 and retain == [Bitmap.prefix(C, 2)] * 2
    assert fold_grouped(rows, [w, w]) == Bitmap.prefix(C, 2)
    assert unfold_grouped(5, C, [w, 2]) == [Bitmap.prefix(C, 5), Bitmap.from_indices([3, 4], C)]
    assert explain_prefix_hit(rows, windows=[-1, w]).groups[1].kind == "full attention"


def test_unfold_grouped_clamps_the_hit_to_c():
    C, windows = 5, [-1, 2, 1, 9]
    top = unfold_grouped(C, C, windows)
    assert [r.runs() for r in top] == [[(0, 5)], [(3, 5)], [(4, 5)], [(0, 5)]]
    for hit in (6, 99, 10**12, 2**64):
        assert unfold_grouped(hit, C, windows) == top
    assert unfold_grouped(0, C, windows) == [Bitmap(C)] * 4
    assert unfold_grouped(2, C, windows) == [
        Bitmap.prefix(C, 2),
        Bitmap.prefix(C, 2),
        Bitmap.from_indices([1], C),
        Bitmap.prefix(C, 2),
    ]


def test_accepted_forms_of_rows_and_windows():
    C = 5
    a, b = Bitmap.from_indices([0, 1, 2, 3], C), Bitmap.from_indices([2, 3, 4], C)
    want = fold_unfold_grouped([a, b], [-1, 2])
    assert want[0] == 4
    assert fold_unfold_grouped((a, b), (-1, 2)) == want
    assert fold_unfold_grouped(iter([a, b]), iter([-1, 2])) == want
    assert fold_unfold_grouped([a, b], np.array([-1, 2])) == want
    assert fold_unfold_grouped([a, b], [np.int32(-1), np.int64(2)]) == want
    assert fold_grouped((r for r in (a, b)), range(-1, 3, 3)) == fold_grouped([a, b], [-1, 2])
    assert unfold_grouped(np.int64(4), np.int64(C), (-1, 2)) == want[1]
    assert explain_prefix_hit((a, b), windows=(-1, 2)).hit == 4


def test_the_kernels_get_the_rows_own_buffers(monkeypatch):
    # No flat copy: the fold kernel is handed each row's packed bytes as they
    # are, and the unfold kernel writes straight into the result rows.
    rows = [Bitmap.from_indices([0, 1, 2, 3], 5), Bitmap.from_indices([2, 3, 4], 5)]
    seen: dict[str, list] = {}
    real_fold, real_unfold = hmem.kernels.bitops.fold_rows_into, hmem.kernels.bitops.unfold_rows_into

    def spy_fold(bufs, C, windows, out):
        seen["fold"] = list(bufs)
        return real_fold(bufs, C, windows, out)

    def spy_unfold(hit, C, windows, outs):
        seen["unfold"] = list(outs)
        return real_unfold(hit, C, windows, outs)

    monkeypatch.setattr(hmem.kernels.bitops, "fold_rows_into", spy_fold)
    monkeypatch.setattr(hmem.kernels.bitops, "unfold_rows_into", spy_unfold)
    hit, retain = fold_unfold_grouped(rows, [-1, 2])
    assert hit == 4
    assert len(seen["fold"]) == 2 and all(got is row.buffer for got, row in zip(seen["fold"], rows))
    assert len(seen["unfold"]) == 2 and all(got is kept.buffer for got, kept in zip(seen["unfold"], retain))


# ---- errors -------------------------------------------------------------------------------------

GROUPED_OPERATORS = {
    "fold_grouped": lambda rows, ws: fold_grouped(rows, ws),
    "fold_unfold_grouped": lambda rows, ws: fold_unfold_grouped(rows, ws),
    "explain_prefix_hit": lambda rows, ws: explain_prefix_hit(rows, windows=ws),
}

B4 = Bitmap.ones(4)


@pytest.mark.parametrize("op", GROUPED_OPERATORS)
@pytest.mark.parametrize(
    "rows, windows, match",
    [
        ([B4, B4], [-1], "2 rows and 1 windows"),
        ([B4], [-1, 2], "1 rows and 2 windows"),
        ([B4, B4, B4], [-1, 1], "3 rows and 2 windows"),
        ([B4, Bitmap(5)], [-1, -1], "different lengths: row 0 has 4 bits, row 1 has 5"),
        ([B4, B4, Bitmap(3)], [-1, 1, 1], "row 2 has 3"),
        ([Bitmap(0), B4], [-1, -1], "different lengths"),
        ([], [-1], "no rows"),
        ((), [-1], "no rows"),
        (iter([]), [-1], "no rows"),
        ([b"\xff"], [-1], "row 0 is a bytes, not a Bitmap"),
        ([B4, [1, 1, 1, 1]], [-1, -1], "row 1 is a list, not a Bitmap"),
        ([np.ones(4, dtype=np.bool_)], [-1], "row 0 is a ndarray, not a Bitmap"),
        (np.ones((2, 4), dtype=np.bool_), [-1, -1], "row 0 is a ndarray, not a Bitmap"),
        ([B4, None], [-1, -1], "row 1 is a NoneType"),
        (b"\xff", [-1], "not a Bitmap"),
        (5, [-1], "rows must be a sequence of Bitmaps"),
        (None, [-1], "rows must be a sequence of Bitmaps"),
        ([B4], [], "windows is empty"),
        ([B4], (), "windows is empty"),
        ([B4], [1.5], "window"),
        ([B4], [2.0], "window"),
        ([B4], ["1"], "window"),
        ([B4], [True], "window"),
        ([B4, B4], [-1, None], "window"),
        ([B4], 3, "windows"),
    ],
)
def test_grouped_operator_errors(op, rows, windows, match):
    with pytest.raises(InvalidArgumentError, match=match) as info:
        GROUPED_OPERATORS[op](rows, windows)
    assert isinstance(info.value, ValueError) and isinstance(info.value, hmem.HmemError)


@pytest.mark.parametrize("op", ["fold_grouped", "fold_unfold_grouped"])
def test_one_bitmap_is_not_a_list_of_rows(op):
    with pytest.raises(InvalidArgumentError, match="got one Bitmap"):
        GROUPED_OPERATORS[op](B4, [-1])
    # explain_prefix_hit takes one Bitmap as a flat map, which needs its shape
    with pytest.raises(InvalidArgumentError, match="num_chunks and num_ranks"):
        explain_prefix_hit(B4, windows=[-1])


def test_missing_windows_is_refused():
    with pytest.raises(InvalidArgumentError, match="windows"):
        fold_grouped([B4], None)
    with pytest.raises(InvalidArgumentError, match="windows"):
        unfold_grouped(2, 4, None)
    with pytest.raises(InvalidArgumentError, match="windows is required"):
        explain_prefix_hit([B4])
    with pytest.raises(InvalidArgumentError, match="windows is required"):
        explain_prefix_hit([B4], 4, 1)


@pytest.mark.parametrize(
    "args, match",
    [
        ((-1, 4, [-1]), "hit must be >= 0, got -1"),
        ((-(2**70), 4, [-1]), "hit must be >= 0"),
        ((2, -4, [-1]), "num_chunks must be >= 0, got -4"),
        ((-1, -1, [-1]), "must be >= 0"),
        ((2.0, 4, [-1]), "hit must be an integer"),
        ((True, 4, [-1]), "hit must be an integer"),
        (("2", 4, [-1]), "hit must be an integer"),
        ((None, 4, [-1]), "hit must be an integer"),
        ((2, 4.0, [-1]), "num_chunks must be an integer"),
        ((2, True, [-1]), "num_chunks must be an integer"),
        ((2, None, [-1]), "num_chunks must be an integer"),
        ((2, 4, []), "windows is empty"),
        ((2, 4, [1.5]), "window"),
        ((2, 4, [False]), "window"),
        ((2, 4, 3), "windows"),
    ],
)
def test_unfold_grouped_errors(args, match):
    with pytest.raises(InvalidArgumentError, match=match) as info:
        unfold_grouped(*args)
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(num_chunks=5), "num_chunks is 5 but the rows hold 4 bits"),
        (dict(num_chunks=0), "num_chunks is 0"),
        (dict(num_chunks=-1), "num_chunks must be >= 0"),
        (dict(num_chunks=4.0), "num_chunks must be an integer"),
        (dict(num_ranks=2), "num_ranks is 2"),
        (dict(num_chunks=4, num_ranks=3), "num_ranks is 3"),
        (dict(num_ranks=0), "num_ranks must be >= 1"),
        (dict(num_ranks=True), "num_ranks must be an integer"),
        (dict(layout="row-major"), "layout"),
        (dict(windows=[-1]), "2 rows and 1 windows"),
    ],
)
def test_explain_prefix_hit_errors_with_rows(kwargs, match):
    kwargs = {"windows": [-1, 2], **kwargs}
    with pytest.raises(InvalidArgumentError, match=match):
        explain_prefix_hit([B4, B4], **kwargs)


@pytest.mark.parametrize(
    "kwargs",
    [dict(windows=[-1]), dict(num_chunks=4, windows=[-1]), dict(num_ranks=1, windows=[-1])],
)
def test_explain_prefix_hit_on_a_flat_map_needs_its_shape(kwargs):
    with pytest.raises(InvalidArgumentError, match="a flat presence map needs num_chunks and num_ranks"):
        explain_prefix_hit(B4, **kwargs)
    # with both, the flat map is explained as before
    assert explain_prefix_hit(B4, 4, 1, [-1]).hit == 4


def test_explain_prefix_hit_with_rows_accepts_the_matching_shape():
    rows = [B4, Bitmap.from_indices([1, 2, 3], 4)]
    base = explain_prefix_hit(rows, windows=[-1, 2])
    assert base.hit == 4 and base.num_chunks == 4 and base.num_ranks == 1
    for kwargs in (dict(num_chunks=4), dict(num_ranks=1), dict(num_chunks=4, num_ranks=1)):
        assert explain_prefix_hit(rows, windows=[-1, 2], **kwargs) == base
    assert explain_prefix_hit(rows, 4, 1, [-1, 2]) == base


def test_errors_leave_the_rows_unchanged():
    rows = [Bitmap.from_indices([0, 2], 4), Bitmap.ones(4)]
    before = [r.to_bytes() for r in rows]
    for call in (
        lambda: fold_grouped(rows, [-1]),
        lambda: fold_unfold_grouped(rows + [Bitmap(5)], [-1, 1, 1]),
        lambda: fold_unfold_grouped(rows, [-1, "x"]),
        lambda: explain_prefix_hit(rows, num_chunks=3, windows=[-1, 1]),
    ):
        with pytest.raises(InvalidArgumentError):
            call()
    assert [r.to_bytes() for r in rows] == before and [len(r) for r in rows] == [4, 4]


# ---- properties: against the brute-force model ----------------------------------------------


@given(case=grouped_cases())
@example(case=([[True, True, False, True, True]], [2]))
@example(case=([[True] * 4, [False, False, False, True]], [-1, 1]))
@example(case=([[]], [-1]))
@example(case=([[True] * 9, [True] * 9], [2**64, -(2**64)]))
def test_grouped_operators_match_the_brute_force_model(case):
    check_against_model(*case)


@settings(max_examples=max(8, settings.default.max_examples // 6))
@given(case=grouped_cases(max_chunks=150, max_rows=4))
def test_grouped_operators_match_the_model_on_longer_rows(case):
    check_against_model(*case)


@given(case=grouped_cases(max_chunks=30), layout=st.sampled_from([GM, CM]), shape_given=st.booleans())
@example(case=([[True, True, False, True]] * 2, [-1, 1]), layout=CM, shape_given=True)
def test_explain_prefix_hit_on_rows_matches_the_model(case, layout, shape_given):
    rows_bits, windows = case
    m = RowModel(rows_bits, windows)
    C, n = m.C, len(rows_bits)
    rows = [to_bitmap(b) for b in rows_bits]
    shape = dict(num_chunks=C, num_ranks=1) if shape_given else {}
    report = explain_prefix_hit(rows, windows=windows, layout=layout, **shape)
    assert report.from_rows and report.num_ranks == 1 and report.num_chunks == C
    assert report.windows == tuple(windows) and report.layout is layout
    assert report.hit == m.hit
    assert bits_of(report.servable) == m.servable
    assert [bits_of(r) for r in report.retain_rows] == m.retain
    assert report.retain == unfold(m.hit, C, 1, windows, layout)
    assert report.retain.indices().tolist() == sorted(
        cell(i, j, 0, C, 1, n, layout) for i in range(n) for j in range(C) if m.retain[i][j]
    )
    assert len(report.groups) == n
    for i, (gh, w) in enumerate(zip(report.groups, windows)):
        assert gh.index == i and gh.window == w
        assert gh.present == rows[i] and gh.present is not rows[i]
        assert gh.first_missing == m.first_missing[i]
        assert gh.own_hit == m.own_hit[i] >= m.hit
        assert gh.needed == unfold_range(m.hit, w) == ((lo_of(w, m.hit), m.hit) if m.hit else (0, 0))
        assert gh.blocks_longer == m.blocks_longer[i]
        assert gh.kind == ("full attention" if w <= 0 else "mamba" if w == 1 else f"window {w}")
    assert report.limiting_groups == tuple(i for i in range(n) if m.blocks_longer[i])
    assert bool(report.limiting_groups) == (m.hit < C)
    # the same cells as a flat map of one-rank groups give the same report, bar retain_rows
    flat = explain_prefix_hit(presence_map([[r] for r in rows], C, layout), C, 1, windows, layout)
    assert not flat.from_rows and flat.retain_rows == ()
    assert (flat.hit, flat.servable, flat.retain, flat.groups) == (
        report.hit,
        report.servable,
        report.retain,
        report.groups,
    )


# ---- properties: against the flat operators on converted inputs -------------------------------


@given(case=flat_cases())
@example(case=(5, 2, [-1, 2], [[[True] * 4 + [False]] * 2, [[False, False, True, True, True]] * 2]))
@example(case=(3, 2, [-1], [[[True] * 3, [True, False, True]]]))
@example(case=(0, 3, [-1, 2], [[[]] * 3, [[]] * 3]))
def test_grouped_matches_the_flat_operators(case):
    C, R, ws, cube = case
    G = len(ws)
    by_group = [[to_bitmap(bits) for bits in ranks] for ranks in cube]
    rows = [row for ranks in by_group for row in ranks]  # group-major
    row_windows = [w for w in ws for _ in range(R)]  # each group's window, once per rank
    servable = fold_grouped(rows, row_windows)
    hit, retain = fold_unfold_grouped(rows, row_windows)
    assert unfold_grouped(hit, C, row_windows) == retain
    report = explain_prefix_hit(rows, windows=row_windows)

    for layout in (GM, CM):
        found = presence_map(by_group, C, layout)
        assert servable == fold(found, C, R, ws, layout)
        flat_hit, mask = fold_unfold_ranked(found, C, R, ws, layout)
        assert hit == flat_hit
        assert retain == [row for ranks in group_rows(mask, C, R, ws, layout) for row in ranks]
        # and back: the retain rows, as a flat map, are the flat retain mask
        assert presence_map([retain[g * R : (g + 1) * R] for g in range(G)], C, layout) == mask

        flat_report = explain_prefix_hit(found, C, R, ws, layout)
        assert (report.hit, report.servable) == (flat_report.hit, flat_report.servable)
        # a group limits the hit iff one of its ranks does
        assert set(flat_report.limiting_groups) == {i // R for i in report.limiting_groups}


# ---- properties: order, inputs untouched, fresh results -------------------------------------


@given(case=grouped_cases(), data=st.data())
def test_permuting_row_window_pairs_permutes_the_result(case, data):
    rows_bits, windows = case
    n = len(windows)
    perm = data.draw(st.permutations(range(n)))
    rows = [to_bitmap(b) for b in rows_bits]
    p_rows, p_windows = [rows[p] for p in perm], [windows[p] for p in perm]
    hit, retain = fold_unfold_grouped(rows, windows)
    p_hit, p_retain = fold_unfold_grouped(p_rows, p_windows)
    assert p_hit == hit
    assert fold_grouped(p_rows, p_windows) == fold_grouped(rows, windows)
    assert p_retain == [retain[p] for p in perm]
    report = explain_prefix_hit(p_rows, windows=p_windows)
    assert report.hit == hit and report.retain_rows == tuple(p_retain)
    assert [g.blocks_longer for g in report.groups] == [
        g.blocks_longer for g in (explain_prefix_hit(rows, windows=windows).groups[p] for p in perm)
    ]


@given(case=grouped_cases(max_chunks=60))
def test_inputs_are_not_modified_and_results_are_fresh(case):
    rows_bits, windows = case
    C = len(rows_bits[0])
    rows = [to_bitmap(b) for b in rows_bits]
    windows_before = list(windows)
    snapshot = [(r.to_bytes(), len(r)) for r in rows]
    buffers = [r.buffer for r in rows]

    servable = fold_grouped(rows, windows)
    hit, retain = fold_unfold_grouped(rows, windows)
    report = explain_prefix_hit(rows, windows=windows)
    unfolded = unfold_grouped(hit, C, windows)
    assert [(r.to_bytes(), len(r)) for r in rows] == snapshot
    assert all(r.buffer is b for r, b in zip(rows, buffers))
    assert windows == windows_before

    # every result is its own Bitmap: no two share bytes, none is an input row
    results = [
        servable,
        *retain,
        *unfolded,
        report.servable,
        report.retain,
        *report.retain_rows,
        *(g.present for g in report.groups),
    ]
    ids = {id(r.buffer) for r in results} | {id(b) for b in buffers}
    assert len(ids) == len(results) + len(rows)

    # mutating a result changes no other result, no input, and no later call
    expect_servable, expect_retain = servable.copy(), [r.copy() for r in retain]
    for bm in [servable, *retain, *unfolded, *report.retain_rows, *(g.present for g in report.groups)]:
        if len(bm):
            bm.set_range(0, len(bm))
    assert [(r.to_bytes(), len(r)) for r in rows] == snapshot
    assert fold_grouped(rows, windows) == expect_servable
    assert fold_unfold_grouped(rows, windows) == (hit, expect_retain)
    assert unfold_grouped(hit, C, windows) == expect_retain


def test_retain_rows_of_equal_windows_are_distinct_objects():
    rows = [Bitmap.ones(6)] * 3  # the same object three times is fine as input
    hit, retain = fold_unfold_grouped(rows, [-1, -1, -1])
    assert hit == 6 and retain == [Bitmap.ones(6)] * 3
    retain[0].clear(2)
    assert retain[1] == retain[2] == Bitmap.ones(6) and rows[0] == Bitmap.ones(6)
    single = fold_grouped(rows[:1], [-1])
    assert single == rows[0] and single is not rows[0] and single.buffer is not rows[0].buffer


# ---- the kernels against their reference twins ---------------------------------------------


def _native_fold(bufs, C, windows, spare=3) -> bytes:
    out = bytearray((C + 7) // 8 + spare)
    native.fold_rows_into(bufs, C, windows, out)
    return bytes(out)


def _reference_fold(bufs, C, windows) -> bytes:
    out = bytearray((C + 7) // 8)
    ref.fold_rows_into(bufs, C, windows, out)
    return bytes(out)


def _native_unfold(hit, C, windows, spare=2) -> list[bytes]:
    outs = [bytearray((C + 7) // 8 + spare) for _ in windows]
    native.unfold_rows_into(hit, C, windows, outs)
    return [bytes(o) for o in outs]


def _reference_unfold(hit, C, windows) -> list[bytes]:
    outs = [bytearray((C + 7) // 8) for _ in windows]
    ref.unfold_rows_into(hit, C, windows, outs)
    return [bytes(o) for o in outs]


def check_kernels(rows_bits, windows, hit, extra: bytes = b"", pad_garbage: int = 0) -> None:
    C = len(rows_bits[0])
    nb = (C + 7) // 8
    bufs = [packed(b, extra, pad_garbage) for b in rows_bits]
    before = [bytes(b) for b in bufs]
    want = _reference_fold(bufs, C, windows)
    got = _native_fold(bufs, C, windows)
    assert got[:nb] == want and got[nb:] == b"\x00" * 3
    assert int.from_bytes(got, "little") >> C == 0
    assert [bytes(b) for b in bufs] == before  # read only
    # read-only row buffers (bytes, memoryview) are accepted
    assert _native_fold([bytes(b) for b in bufs], C, windows) == got
    assert _native_fold([memoryview(bytes(b)) for b in bufs], C, windows) == got
    want_rows = _reference_unfold(hit, C, windows)
    for got_row, want_row in zip(_native_unfold(hit, C, windows), want_rows):
        assert got_row[:nb] == want_row and got_row[nb:] == b"\x00\x00"


@given(
    case=grouped_cases(max_chunks=300, max_rows=6, windows=KERNEL_WINDOWS),
    data=st.data(),
    extra=st.binary(max_size=9),
    pad_garbage=st.integers(0, 255),
)
@example(case=([[True, True, False, True, True]], [2]), data=None, extra=b"", pad_garbage=0)
@example(case=([[True] * 513, [False] * 512 + [True]], [-1, 1]), data=None, extra=b"\xff", pad_garbage=0xFF)
def test_row_kernels_match_the_reference(case, data, extra, pad_garbage):
    rows_bits, windows = case
    C = len(rows_bits[0])
    hit = C if data is None else data.draw(st.integers(0, C))
    check_kernels(rows_bits, windows, hit, extra, pad_garbage)


def seeded_rows(seed: int, n: int, C: int) -> list[list[bool]]:
    """n rows of C bits, each all present, only a tail, or noise of some density."""
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(n):
        kind = int(rng.integers(0, 4))
        if kind == 0:
            rows.append([True] * C)
        elif kind == 1:
            k = int(rng.integers(0, C + 1))
            rows.append([j >= C - k for j in range(C)])
        else:
            rows.append((rng.random(C) < (0.97 if kind == 2 else 0.6)).tolist())
    return rows


@given(C=st.integers(0, 100), n=st.integers(9, 64), seed=st.integers(0, 2**32 - 1), data=st.data())
def test_row_kernels_match_the_reference_with_many_rows(C, n, seed, data):
    windows = data.draw(st.lists(KERNEL_WINDOWS, min_size=n, max_size=n))
    check_kernels(seeded_rows(seed, n, C), windows, data.draw(st.integers(0, C)), b"\xa5", 0xFF)


@st.composite
def long_row_cases(draw):
    """C from 513 to 2000 with long runs: the scans cross 512-bit blocks.  A
    full-attention row starts with at most 700 present chunks, which bounds the
    bit-by-bit reference (it rereads the prefix for every length)."""
    C = draw(st.integers(513, 2000))
    n = draw(st.integers(1, 4))
    windows = draw(st.lists(st.one_of(st.integers(1, 64), st.just(-1)), min_size=n, max_size=n))
    rows = []
    for w in windows:
        bits = draw(row_bits(C))
        if w <= 0:
            bits[min(C - 1, draw(st.integers(0, 700)))] = False
        rows.append(bits)
    return rows, windows


@settings(max_examples=max(8, settings.default.max_examples // 6))
@given(case=long_row_cases(), data=st.data())
def test_row_kernels_match_the_reference_on_long_rows(case, data):
    rows_bits, windows = case
    C = len(rows_bits[0])
    check_kernels(rows_bits, windows, data.draw(st.integers(0, C)), b"\xff" * 70, 0xFF)


@pytest.mark.parametrize("C", [511, 512, 513, 1024, 1031, 2000])
def test_row_kernels_on_long_runs_of_ones_and_zeros(C):
    # Runs longer than 512 bits in every row kind, ends not byte aligned.
    ones, zeros = [True] * C, [False] * C
    half = [j >= C // 2 for j in range(C)]  # a long gap, then a long run
    late_gap = [j != C - 3 for j in range(C)]
    cases = [
        ([ones, half], [-1, 5]),
        ([late_gap, ones], [-1, 1]),
        ([half, half, late_gap], [1, 64, 3]),
        ([ones, zeros], [2, 7]),
        ([[j % 600 < 550 for j in range(C)]], [40]),
    ]
    for rows_bits, windows in cases:
        check_kernels(rows_bits, windows, C, b"\xff", 0xFF)
        m_hit = RowModel(rows_bits, windows).hit
        assert fold_unfold_grouped([to_bitmap(b) for b in rows_bits], windows)[0] == m_hit


# ---- the reference kernels through the public call ------------------------------------------


def test_reference_kernels_give_the_same_answer(run_python):
    code = (
        "import hmem, hmem.kernels as k; from hmem.kernels.reference import bitops as r\n"
        "rows = [hmem.Bitmap.from_indices(ix, 5) for ix in ([0, 1, 2, 3], [0, 1, 2, 3], [2, 3, 4], [1, 3])]\n"
        "hit, retain = hmem.fold_unfold_grouped(rows, [-1, -1, 2, 1])\n"
        "print(k.KERNEL_SET, k.bitops.fold_rows_into is r.fold_rows_into,"
        " k.bitops.unfold_rows_into is r.unfold_rows_into)\n"
        "print(hit, [r.indices().tolist() for r in retain])\n"
        "print(hmem.fold_grouped(rows, [-1, -1, 2, 1]).indices().tolist())\n"
    )
    proc = run_python(code, env={"HMEM_KERNELS": "reference"}, check=True)
    lines = proc.stdout.strip().splitlines()
    assert lines[0] == "reference True True"
    rows = [Bitmap.from_indices(ix, 5) for ix in ([0, 1, 2, 3], [0, 1, 2, 3], [2, 3, 4], [1, 3])]
    hit, retain = fold_unfold_grouped(rows, [-1, -1, 2, 1])
    assert hit == 4 and [r.indices().tolist() for r in retain] == [[0, 1, 2, 3], [0, 1, 2, 3], [2, 3], [3]]
    assert lines[1] == f"{hit} {[r.indices().tolist() for r in retain]}"
    assert lines[2] == str(fold_grouped(rows, [-1, -1, 2, 1]).indices().tolist())
