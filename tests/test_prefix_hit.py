"""The prefix-hit operators (hmem/prefix_hit/operators.py): hand-worked cases, argument
errors, and properties checked against the reference kernels and against a
brute-force model that applies the definition literally."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

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
    TrimPolicy,
    chunks_present,
    explain_prefix_hit,
    fold,
    fold_unfold,
    fold_unfold_ranked,
    group_rows,
    highest_set_bit,
    merge_bitmaps,
    presence_bits,
    presence_map,
    select_retained,
    unfold,
    unfold_range,
)
from hmem.kernels.reference import bitops as ref

GM, CM = Layout.GROUP_MAJOR, Layout.CHUNK_MAJOR

# ---- the brute-force model ------------------------------------------------------------


def cell(g: int, j: int, r: int, C: int, R: int, G: int, layout: Layout) -> int:
    """Index of group g, chunk j, rank r in a flat presence map (hmem/prefix_hit/operators.py)."""
    return j * G * R + g * R + r if layout is CM else g * C * R + j * R + r


def lo_of(window: int, L: int) -> int:
    return 0 if window <= 0 else max(0, L - window)


@dataclass
class Model:
    present: list[list[bool]]  # [g][j]: chunk j present on all ranks of group g
    servable: list[bool]  # [L - 1]: length L servable by every group
    hit: int
    retain: list[int]  # sorted flat indices of the retain mask
    own_hit: list[int]  # [g]: longest length group g alone serves
    serves: list[list[bool]]  # [g][L]: group g alone serves length L (L = 0..C)


def brute(bits: list[bool], C: int, R: int, windows: list[int], layout: Layout) -> Model:
    """The definition, literally: L is servable when every group has every chunk
    of [lo, L) on every rank."""
    G = len(windows)
    assert len(bits) == G * C * R
    present = [[all(bits[cell(g, j, r, C, R, G, layout)] for r in range(R)) for j in range(C)] for g in range(G)]
    serves = [[L == 0 or all(present[g][lo_of(windows[g], L) : L]) for L in range(C + 1)] for g in range(G)]
    servable = [all(serves[g][L] for g in range(G)) for L in range(1, C + 1)]
    hit = max((L for L in range(1, C + 1) if servable[L - 1]), default=0)
    retain = sorted(
        cell(g, j, r, C, R, G, layout) for g in range(G) for j in range(lo_of(windows[g], hit), hit) for r in range(R)
    )
    own_hit = [max((L for L in range(1, C + 1) if serves[g][L]), default=0) for g in range(G)]
    return Model(present, servable, hit, retain, own_hit, serves)


def to_bitmap(bits) -> Bitmap:
    return Bitmap.from_numpy(np.asarray(bits, dtype=np.bool_).reshape(-1))


def from_cells(cells, C: int, R: int, G: int, layout: Layout = GM) -> Bitmap:
    """Presence map from (g, j, r) triples."""
    return Bitmap.from_indices([cell(g, j, r, C, R, G, layout) for g, j, r in cells], G * C * R)


def from_chunks(chunks_per_group, C: int, R: int = 1, layout: Layout = GM) -> Bitmap:
    """Presence map where group g holds every rank of chunks_per_group[g]."""
    G = len(chunks_per_group)
    return from_cells(
        [(g, j, r) for g, js in enumerate(chunks_per_group) for j in js for r in range(R)], C, R, G, layout
    )


def tail_is_clear(bm: Bitmap) -> bool:
    return int.from_bytes(bm.to_bytes(), "little") >> len(bm) == 0


# ---- strategies ---------------------------------------------------------------------------

WINDOWS = st.one_of(
    st.sampled_from([FULL_ATTENTION_WINDOW, 0, -7]),
    st.integers(1, 6),
    st.integers(7, 5000),  # often larger than C
)


@st.composite
def presence_cases(draw, max_chunks: int = 24, max_groups: int = 4, max_ranks: int = 3, big: bool = False):
    """(C, R, windows, layout, bits) with bits a flat list in `layout`."""
    G = draw(st.integers(1, max_groups))
    R = draw(st.integers(1, max_ranks))
    C = draw(st.integers(0, max_chunks)) if not big else draw(st.integers(200, max_chunks))
    windows = draw(st.lists(WINDOWS, min_size=G, max_size=G))
    layout = draw(st.sampled_from([GM, CM]))
    N = G * C * R
    modes = ["holes", "chunk-holes", "runs"] + ([] if big else ["random"])
    mode = draw(st.sampled_from(modes))
    if mode == "random":
        bits = draw(st.lists(st.booleans(), min_size=N, max_size=N))
    elif mode == "holes":  # all present but a few rank bits
        holes = set(draw(st.lists(st.integers(0, max(0, N - 1)), max_size=8))) if N else set()
        bits = [i not in holes for i in range(N)]
    elif mode == "chunk-holes":  # whole chunks or single ranks missing, per group
        bits = [True] * N
        if C:
            for g, j, r, whole in draw(
                st.lists(
                    st.tuples(st.integers(0, G - 1), st.integers(0, C - 1), st.integers(0, R - 1), st.booleans()),
                    max_size=3 * G,
                )
            ):
                for rr in range(R) if whole else [r]:
                    bits[cell(g, j, rr, C, R, G, layout)] = False
    else:  # long runs of ones and zeros in flat order
        bits, value = [], draw(st.booleans())
        while len(bits) < N:
            run = draw(st.integers(1, max(1, N)))
            bits.extend([value] * min(run, N - len(bits)))
            value = not value
    return C, R, windows, layout, bits


def check_against_model(C, R, windows, layout, bits) -> Model:
    """Every operator of the pipeline agrees with the brute-force model."""
    G = len(windows)
    N = G * C * R
    found = to_bitmap(bits)
    m = brute(bits, C, R, windows, layout)

    servable = fold(found, C, R, windows, layout)
    assert len(servable) == C and tail_is_clear(servable)
    assert servable.to_numpy().tolist() == m.servable

    hit, mask = fold_unfold_ranked(found, C, R, windows, layout)
    assert hit == m.hit
    assert 0 <= hit <= C
    assert highest_set_bit(servable) + 1 == hit
    assert len(mask) == N and tail_is_clear(mask)
    assert mask.indices().tolist() == m.retain
    assert mask == unfold(hit, C, R, windows, layout)
    # every retained cell is present on all ranks, and the mask has the size
    # the windows say
    assert (mask & found) == mask
    assert mask.popcount() == R * sum(hit - lo_of(w, hit) for w in windows)
    # the hit is servable and nothing longer is
    if hit:
        assert servable.test(hit - 1)
    assert not servable.to_numpy()[hit:].any()
    return m


# ---- hand-worked cases ------------------------------------------------------------------


@pytest.mark.parametrize(
    "chunks, hit",
    [({0, 1, 2}, 3), ({0, 1, 3}, 2), ({1, 2}, 0), ({0, 1, 2, 3}, 4), (set(), 0), ({0}, 1), ({3}, 0)],
)
def test_one_full_attention_group(chunks, hit):
    found = Bitmap.from_indices(sorted(chunks), 4)
    got_hit, mask = fold_unfold(found, 4, [FULL_ATTENTION_WINDOW])
    assert got_hit == hit
    assert mask == Bitmap.prefix(4, hit)
    assert fold_unfold_ranked(found, 4, 1, [-1]) == (hit, mask)
    assert fold(found, 4, 1, [-1]) == Bitmap.prefix(4, hit)
    assert highest_set_bit(fold(found, 4, 1, [-1])) == hit - 1
    # one full-attention group, R = 1: the hit is the count of leading ones
    assert got_hit == found.leading_ones()


def test_full_attention_plus_window_two():
    # C = 5: A full attention holds {0,1,2,3}, B window 2 holds {2,3,4}.
    C = 5
    found = from_chunks([{0, 1, 2, 3}, {2, 3, 4}], C)
    hit, mask = fold_unfold(found, C, [-1, 2])
    assert hit == 4
    assert fold(found, C, 1, [-1, 2]).indices().tolist() == [3]  # only length 4
    assert mask == from_chunks([{0, 1, 2, 3}, {2, 3}], C)


def test_window_group_needs_only_its_last_chunks():
    # C = 6: A full attention holds everything, B window 2 holds only {4, 5}.
    C = 6
    found = from_chunks([range(6), {4, 5}], C)
    hit, mask = fold_unfold(found, C, [-1, 2])
    assert hit == 6
    assert mask == from_chunks([range(6), {4, 5}], C)
    assert fold(found, C, 1, [-1, 2]).indices().tolist() == [5]


def test_mamba_group_holding_only_the_last_chunk_does_not_block():
    C = 4
    found = from_chunks([range(4), {3}], C)
    hit, mask = fold_unfold(found, C, [-1, 1])
    assert hit == 4
    assert mask == from_chunks([range(4), {3}], C)
    # the mamba group's own servable lengths: only those ending on a present chunk
    assert fold(from_chunks([{3}], C), C, 1, [1]).indices().tolist() == [3]


@pytest.mark.parametrize("layout", [GM, CM])
def test_a_chunk_missing_one_rank_stops_the_prefix(layout):
    C, R = 3, 2
    cells = [(0, j, r) for j in range(C) for r in range(R) if (j, r) != (1, 1)]
    found = from_cells(cells, C, R, 1, layout)
    hit, mask = fold_unfold_ranked(found, C, R, [-1], layout)
    assert hit == 1
    assert mask == from_cells([(0, 0, 0), (0, 0, 1)], C, R, 1, layout)
    assert chunks_present(found, C, R, [-1], layout)[0].indices().tolist() == [0, 2]


def test_sliding_window_servable_lengths_have_gaps():
    # window 2 with chunks {0,1,3,4} of 5: servable lengths {1, 2, 5}
    found = Bitmap.from_indices([0, 1, 3, 4], 5)
    servable = fold(found, 5, 1, [2])
    assert servable.indices().tolist() == [0, 1, 4]
    hit, mask = fold_unfold(found, 5, [2])
    assert hit == 5  # the highest servable length, not the leading ones (2)
    assert mask.indices().tolist() == [3, 4]


def test_unfold_hand_worked_both_layouts():
    assert unfold(4, 5, 2, [-1, 2]).indices().tolist() == [*range(8), *range(14, 18)]
    assert unfold(4, 5, 2, [-1, 2], GM) == unfold(4, 5, 2, [-1, 2], "group-major")
    assert unfold(4, 5, 2, [-1, 2], CM).indices().tolist() == [0, 1, 4, 5, *range(8, 16)]
    assert unfold(4, 5, 2, [-1, 2], "chunk-major") == unfold(4, 5, 2, [-1, 2], CM)
    assert len(unfold(4, 5, 2, [-1, 2])) == 20


@pytest.mark.parametrize("layout", [GM, CM])
def test_unfold_clamps_the_hit_to_c(layout):
    for hit in (5, 6, 99, 10**12):
        assert unfold(hit, 5, 2, [-1, 2], layout) == unfold(5, 5, 2, [-1, 2], layout)
    assert unfold(99, 5, 1, [-1]) == Bitmap.ones(5)
    assert unfold(0, 5, 2, [-1, 2], layout) == Bitmap(20)


@pytest.mark.parametrize("layout", [GM, CM])
def test_zero_chunks(layout):
    assert fold(Bitmap(0), 0, 2, [-1, 3], layout) == Bitmap(0)
    assert fold_unfold_ranked(Bitmap(0), 0, 2, [-1, 3], layout) == (0, Bitmap(0))
    assert fold_unfold(Bitmap(0), 0, [1], layout) == (0, Bitmap(0))
    assert unfold(0, 0, 2, [-1, 3], layout) == Bitmap(0)
    assert unfold(7, 0, 2, [-1, 3], layout) == Bitmap(0)
    report = explain_prefix_hit(Bitmap(0), 0, 2, [-1, 3], layout)
    assert report.hit == 0 and report.limiting_groups == ()
    assert all(g.first_missing is None and g.own_hit == 0 and g.needed == (0, 0) for g in report.groups)
    assert chunks_present(Bitmap(0), 0, 2, [-1, 3], layout) == [Bitmap(0), Bitmap(0)]


@pytest.mark.parametrize("layout", [GM, CM])
@pytest.mark.parametrize("w", [0, -1, -7, FULL_ATTENTION_WINDOW])
def test_every_window_at_or_below_zero_is_full_attention(w, layout):
    C = 6
    # group 1 lacks chunk 2: a window of 2 would serve length 6, full attention only 2
    found = from_chunks([range(C), {0, 1, 3, 4, 5}], C, 1, layout)
    assert fold(found, C, 1, [-1, 2], layout).indices().tolist() == [0, 1, 4, 5]
    hit, mask = fold_unfold(found, C, [-1, w], layout)
    assert hit == 2
    assert mask == from_chunks([{0, 1}, {0, 1}], C, 1, layout)
    assert fold(found, C, 1, [w, w], layout).indices().tolist() == [0, 1]
    assert unfold(5, C, 1, [w, 2], layout) == from_chunks([range(5), {3, 4}], C, 1, layout)
    assert unfold_range(5, w) == (0, 5)
    assert explain_prefix_hit(found, C, 1, [-1, w], layout).groups[1].kind == "full attention"


def test_full_attention_window_constant_and_layout_names():
    assert FULL_ATTENTION_WINDOW == -1
    assert Layout("group-major") is GM and Layout("chunk-major") is CM
    assert TrimPolicy("prefix") is TrimPolicy.PREFIX and TrimPolicy("keep-all") is TrimPolicy.KEEP_ALL
    assert presence_bits(5, 2, [-1, 2, 1]) == 30
    assert presence_bits(0, 3, [1]) == 0


def test_windows_larger_than_c():
    C = 5
    found = from_chunks([{0, 1, 2, 4}], C)
    for w in (5, 6, 100, 2**40):
        assert fold(found, C, 1, [w]) == fold(found, C, 1, [-1])
        assert fold_unfold(found, C, [w]) == (3, Bitmap.prefix(5, 3))
        assert unfold(5, C, 1, [w]) == Bitmap.ones(5)


# ---- unfold_range, merge_bitmaps, select_retained, highest_set_bit ---------------------------


@pytest.mark.parametrize(
    "length, window, expected",
    [
        (0, -1, (0, 0)),
        (0, 3, (0, 0)),
        (-3, 2, (0, 0)),
        (5, -1, (0, 5)),
        (5, 0, (0, 5)),
        (5, -7, (0, 5)),
        (5, 2, (3, 5)),
        (5, 1, (4, 5)),
        (1, 2, (0, 1)),
        (5, 5, (0, 5)),
        (5, 10, (0, 5)),
    ],
)
def test_unfold_range(length, window, expected):
    assert unfold_range(length, window) == expected


@pytest.mark.parametrize("bad", [(1.5, 2), (3, "2"), (True, 2), (None, 1)])
def test_unfold_range_refuses_non_integers(bad):
    with pytest.raises(InvalidArgumentError):
        unfold_range(*bad)


def test_merge_bitmaps():
    l1 = Bitmap.from_indices([0, 1, 5], 10)
    l2 = Bitmap.from_indices([2, 5, 9], 10)
    merged = merge_bitmaps([l1, l2], 10)
    assert merged.indices().tolist() == [0, 1, 2, 5, 9]
    assert merge_bitmaps([], 10) == Bitmap(10)
    assert merge_bitmaps(iter([l1]), 10) == l1
    # a shorter map counts as absent past its end; a longer one is cut
    assert merge_bitmaps([Bitmap.ones(3), Bitmap.from_indices([4, 12], 13)], 10).indices().tolist() == [0, 1, 2, 4]
    # the inputs are untouched
    assert l1.indices().tolist() == [0, 1, 5]
    with pytest.raises(InvalidArgumentError):
        merge_bitmaps([l1], -1)
    with pytest.raises(InvalidArgumentError):
        merge_bitmaps([l1, b"\xff"], 10)


def test_merge_then_fold_reports_no_bit_past_the_length():
    # A longer map merged into an N-bit presence map must not leak past N.
    C, R, W = 5, 1, [-1]
    merged = merge_bitmaps([Bitmap.from_indices([0, 1], 5), Bitmap.ones(16)], 5)
    assert merged == Bitmap.ones(5) and merged.highest_set_bit() == 4
    assert fold_unfold_ranked(merged, C, R, W) == (5, Bitmap.ones(5))
    only_tail = merge_bitmaps([Bitmap.from_indices([5, 6, 7], 8)], 5)
    assert only_tail.highest_set_bit() == -1
    assert fold_unfold_ranked(only_tail, C, R, W) == (0, Bitmap(5))


def test_select_retained():
    found = Bitmap.from_indices([0, 1, 2, 5, 6], 8)
    assert select_retained(found, 8).indices().tolist() == [0, 1, 2]
    assert select_retained(found, 8, TrimPolicy.PREFIX) == Bitmap.prefix(8, 3)
    assert select_retained(found, 8, "prefix") == Bitmap.prefix(8, 3)
    kept = select_retained(found, 8, TrimPolicy.KEEP_ALL)
    assert kept == found and kept is not found
    kept.clear(5)
    assert found.test(5)  # a copy, not a view
    assert select_retained(found, 8, "keep-all") == found
    assert select_retained(Bitmap.from_indices([1, 2], 8), 8) == Bitmap(8)
    assert select_retained(Bitmap(0), 0) == Bitmap(0)


def test_select_retained_errors():
    with pytest.raises(InvalidArgumentError, match="policy"):
        select_retained(Bitmap(8), 8, "suffix")
    with pytest.raises(InvalidArgumentError):
        select_retained(Bitmap(8), 9)
    with pytest.raises(InvalidArgumentError):
        select_retained(b"\xff", 8)


def test_highest_set_bit_operator():
    assert highest_set_bit(Bitmap(0)) == -1
    assert highest_set_bit(Bitmap(13)) == -1
    assert highest_set_bit(Bitmap.from_indices([3, 12], 13)) == 12
    assert highest_set_bit(Bitmap.ones(1)) == 0
    with pytest.raises(InvalidArgumentError):
        highest_set_bit(b"\x01")
    with pytest.raises(InvalidArgumentError):
        highest_set_bit(5)


# ---- grouped form ---------------------------------------------------------------------------


@pytest.mark.parametrize("layout", [GM, CM])
def test_presence_map_and_group_rows_use_the_spec_bit_order(layout):
    C, R, G = 3, 2, 2
    rows = [[Bitmap.from_indices([0, 2], C), Bitmap.from_indices([2], C)], [Bitmap(C), Bitmap.ones(C)]]
    found = presence_map(rows, C, layout)
    expected = [cell(0, 0, 0, C, R, G, layout), cell(0, 2, 0, C, R, G, layout), cell(0, 2, 1, C, R, G, layout)]
    expected += [cell(1, j, 1, C, R, G, layout) for j in range(C)]
    assert found.indices().tolist() == sorted(expected)
    assert group_rows(found, C, R, [-1, 1], layout) == rows
    assert chunks_present(found, C, R, [-1, 1], layout) == [Bitmap.from_indices([2], C), Bitmap(C)]


def test_presence_map_errors():
    with pytest.raises(InvalidArgumentError):
        presence_map([], 3)
    with pytest.raises(InvalidArgumentError):
        presence_map([[]], 3)
    with pytest.raises(InvalidArgumentError):
        presence_map([[Bitmap(3)], [Bitmap(3), Bitmap(3)]], 3)
    with pytest.raises(InvalidArgumentError):
        presence_map([[Bitmap(4)]], 3)
    with pytest.raises(InvalidArgumentError):
        presence_map([[b"\x00"]], 3)
    with pytest.raises(InvalidArgumentError, match="layout"):
        presence_map([[Bitmap(3)]], 3, "row-major")


# ---- errors -------------------------------------------------------------------------------------

OPERATORS = {
    "fold": lambda f, C, R, W, lay: fold(f, C, R, W, lay),
    "fold_unfold_ranked": lambda f, C, R, W, lay: fold_unfold_ranked(f, C, R, W, lay),
    "explain_prefix_hit": lambda f, C, R, W, lay: explain_prefix_hit(f, C, R, W, lay),
    "chunks_present": lambda f, C, R, W, lay: chunks_present(f, C, R, W, lay),
    "group_rows": lambda f, C, R, W, lay: group_rows(f, C, R, W, lay),
}


@pytest.mark.parametrize("op", OPERATORS)
@pytest.mark.parametrize(
    "args, match",
    [
        ((Bitmap(0), 4, 0, [-1]), "num_ranks"),
        ((Bitmap(0), 4, -2, [-1]), "num_ranks"),
        ((Bitmap(0), 4, 1, []), "windows"),
        ((Bitmap(0), 4, 1, ()), "windows"),
        ((Bitmap(0), -1, 1, [-1]), "num_chunks"),
        ((Bitmap(7), 4, 2, [-1]), "7 bits"),
        ((Bitmap(9), 4, 2, [-1]), "9 bits"),
        ((Bitmap(8), 4, 2, [-1, 1]), "16"),
        ((b"\xff", 4, 2, [-1]), "Bitmap"),
        (([1, 1, 1, 1], 4, 1, [-1]), "Bitmap"),
        ((np.ones(4, dtype=np.bool_), 4, 1, [-1]), "Bitmap"),
        ((Bitmap(4), 4.0, 1, [-1]), "num_chunks"),
        ((Bitmap(4), True, 1, [-1]), "num_chunks"),
        ((Bitmap(4), 4, 1, [1.5]), "window"),
        ((Bitmap(4), 4, 1, ["1"]), "window"),
        ((Bitmap(4), 4, 1, 3), "windows"),
    ],
)
@pytest.mark.parametrize("layout", [GM, CM])
def test_operator_errors(op, args, match, layout):
    with pytest.raises(InvalidArgumentError, match=match) as info:
        OPERATORS[op](*args, layout)
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize("op", OPERATORS)
def test_unknown_layout_is_refused(op):
    with pytest.raises(InvalidArgumentError, match="layout"):
        OPERATORS[op](Bitmap(4), 4, 1, [-1], "row-major")
    with pytest.raises(InvalidArgumentError, match="layout"):
        unfold(2, 4, 1, [-1], "GROUP_MAJOR")


@pytest.mark.parametrize("layout", [GM, CM])
def test_presence_map_length_must_match_in_either_layout(layout):
    # G*C*R = 2*3*2 = 12; the same number of bits in the other factorisation
    # still has to be exactly 12
    for n in (0, 6, 11, 13, 24):
        with pytest.raises(InvalidArgumentError, match="12"):
            fold(Bitmap(n), 3, 2, [-1, 1], layout)
    assert len(fold(Bitmap(12), 3, 2, [-1, 1], layout)) == 3


def test_fold_unfold_errors():
    with pytest.raises(InvalidArgumentError):
        fold_unfold(Bitmap(5), 4, [-1])
    with pytest.raises(InvalidArgumentError):
        fold_unfold(Bitmap(4), 4, [])
    with pytest.raises(InvalidArgumentError):
        fold_unfold(Bitmap(0), -1, [-1])
    with pytest.raises(InvalidArgumentError):
        fold_unfold("1111", 4, [-1])


@pytest.mark.parametrize(
    "args, match",
    [
        ((-1, 4, 1, [-1]), "hit"),
        ((-100, 4, 1, [-1]), "hit"),
        ((2, 4, 0, [-1]), "num_ranks"),
        ((2, 4, 1, []), "windows"),
        ((2, -4, 1, [-1]), "num_chunks"),
        ((2.0, 4, 1, [-1]), "hit"),
        ((True, 4, 1, [-1]), "hit"),
    ],
)
def test_unfold_errors(args, match):
    with pytest.raises(InvalidArgumentError, match=match):
        unfold(*args)
    with pytest.raises(InvalidArgumentError, match=match):
        unfold(*args, layout=CM)


def test_presence_bits_errors():
    with pytest.raises(InvalidArgumentError):
        presence_bits(3, 0, [-1])
    with pytest.raises(InvalidArgumentError):
        presence_bits(3, 1, [])
    with pytest.raises(InvalidArgumentError):
        presence_bits(-3, 1, [1])


def test_errors_are_hmem_errors_with_a_message():
    with pytest.raises(hmem.HmemError) as info:
        fold(Bitmap(7), 4, 2, [-1])
    assert "7" in str(info.value) and "8" in str(info.value)


# ---- properties: against the reference kernels --------------------------------------------------


@given(case=presence_cases())
@example(case=(5, 1, [2], GM, [True, True, False, True, True]))
@example(case=(3, 1, [-1, 1, 2], CM, [True] * 9))
def test_fold_and_unfold_match_the_reference_kernels(case):
    C, R, windows, layout, bits = case
    found = to_bitmap(bits)
    chunk_major = layout is CM
    expected_fold = bytearray((C + 7) // 8)
    ref.fold_into(bytearray(found.to_bytes()), C, R, windows, chunk_major, expected_fold)
    assert fold(found, C, R, windows, layout).to_bytes() == bytes(expected_fold)
    N = len(windows) * C * R
    for hit in {0, C // 2, C, max(0, C - 1)}:
        expected_mask = bytearray((N + 7) // 8)
        ref.unfold_into(hit, C, R, windows, chunk_major, expected_mask)
        assert unfold(hit, C, R, windows, layout).to_bytes() == bytes(expected_mask)


# ---- properties: against the brute-force model -------------------------------------------------


@given(case=presence_cases())
@example(case=(5, 1, [2], GM, [True, True, False, True, True]))
@example(case=(4, 2, [1, -1], CM, [True] * 14 + [False, True]))
@example(case=(0, 3, [-1, 2], GM, []))
def test_pipeline_matches_the_brute_force_model(case):
    check_against_model(*case)


@settings(max_examples=max(8, settings.default.max_examples // 4))
@given(case=presence_cases(max_chunks=700, max_groups=3, max_ranks=4, big=True))
def test_pipeline_matches_the_model_on_large_shapes(case):
    # C*R far above 512 bits per group, long runs of ones and zeros: the
    # kernels' word- and block-skipping paths.
    check_against_model(*case)


@pytest.mark.parametrize(
    "G, R, layout",
    [(3, 1, CM), (8, 8, CM), (5, 3, CM), (2, 4, CM), (1, 1, GM), (3, 1, GM), (8, 8, GM)],
)
def test_large_shapes_with_long_runs(G, R, layout):
    # Rows of G*R bits that are (8x8, 2x4) and are not (3x1, 5x3) whole bytes.
    C = 300
    windows = [[-1, 2, 1, 50, 0, 400, 7, 3][g % 8] for g in range(G)]
    rng = np.random.default_rng(G * 100 + R)
    for trial in range(6):
        cube = np.ones((G, C, R), dtype=np.bool_)
        if trial == 1:  # a few single-rank holes late in non-full groups
            for g in range(1, G):
                cube[g, rng.integers(C // 2, C), rng.integers(0, R)] = False
        elif trial == 2:  # long gap in the windowed groups
            cube[1:, 40:220, :] = False
        elif trial == 3:  # the full-attention group breaks late
            cube[0, 290, R - 1] = False
        elif trial == 4:  # random sparse holes everywhere
            cube &= rng.random((G, C, R)) > 0.002
        elif trial == 5:  # nothing present
            cube[:] = False
        flat = cube if layout is GM else cube.transpose(1, 0, 2)
        check_against_model(C, R, windows, layout, flat.reshape(-1).tolist())


@given(case=presence_cases())
def test_all_full_attention_hit_is_leading_ones_of_the_chunk_and(case):
    C, R, windows, layout, bits = case
    windows = [min(w, 0) for w in windows]  # every group full attention
    found = to_bitmap(bits)
    G = len(windows)
    both = Bitmap.ones(C)
    for present in chunks_present(found, C, R, windows, layout):
        both = both & present
    hit, mask = fold_unfold_ranked(found, C, R, windows, layout)
    assert hit == both.leading_ones()
    assert fold(found, C, R, windows, layout) == Bitmap.prefix(C, hit)
    assert mask == from_cells([(g, j, r) for g in range(G) for j in range(hit) for r in range(R)], C, R, G, layout)


@given(bits=st.lists(st.booleans(), max_size=120), w=st.sampled_from([-1, 0, -3]))
def test_one_full_attention_group_rank_one_is_leading_ones(bits, w):
    found = to_bitmap(bits)
    C = len(bits)
    hit, mask = fold_unfold(found, C, [w])
    assert hit == found.leading_ones()
    assert mask == select_retained(found, C, TrimPolicy.PREFIX)


@given(case=presence_cases(max_ranks=1))
def test_rank_one_ranked_equals_unranked(case):
    C, R, windows, layout, bits = case
    found = to_bitmap(bits)
    assert fold_unfold_ranked(found, C, 1, windows, layout) == fold_unfold(found, C, windows, layout)


@given(case=presence_cases(), data=st.data())
def test_permuting_groups_permutes_the_mask_and_keeps_the_hit(case, data):
    C, R, windows, layout, bits = case
    G = len(windows)
    perm = data.draw(st.permutations(range(G)))
    found = to_bitmap(bits)
    rows = group_rows(found, C, R, windows, layout)
    p_windows = [windows[p] for p in perm]
    p_found = presence_map([rows[p] for p in perm], C, layout)
    hit, mask = fold_unfold_ranked(found, C, R, windows, layout)
    p_hit, p_mask = fold_unfold_ranked(p_found, C, R, p_windows, layout)
    assert p_hit == hit
    assert fold(p_found, C, R, p_windows, layout) == fold(found, C, R, windows, layout)
    mask_rows = group_rows(mask, C, R, windows, layout)
    assert group_rows(p_mask, C, R, p_windows, layout) == [mask_rows[p] for p in perm]


@given(case=presence_cases())
@example(case=(20, 1, [-1, 2, 1], CM, [True] * 60))  # rows of 3 bits
@example(case=(9, 8, [-1] * 4 + [1, 2, 3, 40], CM, [True] * 576))  # rows of 64 bits
def test_group_major_and_chunk_major_agree(case):
    C, R, windows, layout, bits = case
    found = to_bitmap(bits)
    rows = group_rows(found, C, R, windows, layout)
    gm = presence_map(rows, C, GM)
    cm = presence_map(rows, C, CM)
    assert found == (gm if layout is GM else cm)
    assert group_rows(gm, C, R, windows, GM) == rows == group_rows(cm, C, R, windows, CM)
    assert chunks_present(gm, C, R, windows, GM) == chunks_present(cm, C, R, windows, CM)
    assert fold(gm, C, R, windows, GM) == fold(cm, C, R, windows, CM)
    hit_gm, mask_gm = fold_unfold_ranked(gm, C, R, windows, GM)
    hit_cm, mask_cm = fold_unfold_ranked(cm, C, R, windows, CM)
    assert hit_gm == hit_cm
    mask_rows = group_rows(mask_gm, C, R, windows, GM)
    assert group_rows(mask_cm, C, R, windows, CM) == mask_rows
    assert presence_map(mask_rows, C, CM) == mask_cm
    # the reordering is exactly the cell formula of hmem/prefix_hit/operators.py
    G = len(windows)
    order = [cell(g, j, r, C, R, G, CM) for g in range(G) for j in range(C) for r in range(R)]
    assert (cm.to_numpy()[order] == gm.to_numpy()).all()


@given(case=presence_cases())
def test_windows_at_least_c_act_as_full_attention(case):
    C, R, windows, layout, bits = case
    found = to_bitmap(bits)
    as_full = [-1 if w >= max(C, 1) else w for w in windows]
    assert fold(found, C, R, windows, layout) == fold(found, C, R, as_full, layout)
    assert fold_unfold_ranked(found, C, R, windows, layout) == fold_unfold_ranked(found, C, R, as_full, layout)


@given(case=presence_cases(), data=st.data())
def test_nothing_past_the_first_full_attention_gap_matters(case, data):
    C, R, windows, layout, bits = case
    G = len(windows)
    m = brute(bits, C, R, windows, layout)
    gaps = [next((j for j in range(C) if not m.present[g][j]), C) for g in range(G) if windows[g] <= 0]
    k = min(gaps, default=C)
    assert m.hit <= k
    scrambled = list(bits)
    for g, j, r in itertools.product(range(G), range(k + 1, C), range(R)):
        scrambled[cell(g, j, r, C, R, G, layout)] = data.draw(st.booleans())
    assert fold(to_bitmap(scrambled), C, R, windows, layout) == fold(to_bitmap(bits), C, R, windows, layout)


# ---- explain_prefix_hit ------------------------------------------------------------------------


def test_explain_prefix_hit_hand_worked():
    # C = 5: A full attention {0,1,2,3}, B window 2 {2,3,4}, M mamba {0}
    C = 5
    found = from_chunks([{0, 1, 2, 3}, {2, 3, 4}, {0, 3}], C)
    report = explain_prefix_hit(found, C, 1, [-1, 2, 1])
    assert report.hit == 4
    assert report.num_chunks == 5 and report.num_ranks == 1
    assert report.windows == (-1, 2, 1) and report.layout is GM
    assert report.servable == fold(found, C, 1, [-1, 2, 1])
    assert report.retain == from_chunks([range(4), {2, 3}, {3}], C)
    a, b, m = report.groups
    assert (a.index, a.kind, a.first_missing, a.own_hit, a.needed, a.blocks_longer) == (
        0,
        "full attention",
        4,
        4,
        (0, 4),
        True,
    )
    assert (b.index, b.kind, b.first_missing, b.own_hit, b.needed, b.blocks_longer) == (
        1,
        "window 2",
        0,
        5,
        (2, 4),
        False,
    )
    assert (m.index, m.kind, m.first_missing, m.own_hit, m.needed, m.blocks_longer) == (
        2,
        "mamba",
        1,
        4,
        (3, 4),
        True,
    )
    assert a.present == Bitmap.from_indices([0, 1, 2, 3], C)
    assert report.limiting_groups == (0, 2)


def test_explain_prefix_hit_full_hit_has_no_limiting_group():
    C = 3
    report = explain_prefix_hit(Bitmap.ones(6), C, 1, [-1, 2])
    assert report.hit == 3 and report.limiting_groups == ()
    assert [g.first_missing for g in report.groups] == [None, None]
    assert [g.needed for g in report.groups] == [(0, 3), (1, 3)]


@given(case=presence_cases())
def test_explain_prefix_hit_matches_the_model(case):
    C, R, windows, layout, bits = case
    found = to_bitmap(bits)
    m = brute(bits, C, R, windows, layout)
    report = explain_prefix_hit(found, C, R, windows, layout)
    assert report.hit == m.hit
    assert report.num_chunks == C and report.num_ranks == R
    assert report.windows == tuple(windows) and report.layout is layout
    assert report.servable.to_numpy().tolist() == m.servable
    assert report.retain.indices().tolist() == m.retain
    assert len(report.groups) == len(windows)
    for g, (gh, w) in enumerate(zip(report.groups, windows)):
        assert gh.index == g and gh.window == w
        assert gh.present.to_numpy().tolist() == m.present[g]
        missing = next((j for j in range(C) if not m.present[g][j]), None)
        assert gh.first_missing == missing
        assert gh.own_hit == m.own_hit[g]
        assert gh.own_hit >= m.hit
        assert gh.needed == ((lo_of(w, m.hit), m.hit) if m.hit else (0, 0))
        assert gh.needed == unfold_range(m.hit, w)
        assert gh.blocks_longer == (m.hit < C and not m.serves[g][m.hit + 1])
        assert gh.kind == ("full attention" if w <= 0 else "mamba" if w == 1 else f"window {w}")
    assert report.limiting_groups == tuple(g for g in range(len(windows)) if m.hit < C and not m.serves[g][m.hit + 1])
    # a hit short of C is always limited by at least one group
    assert bool(report.limiting_groups) == (m.hit < C)


# ---- select_retained and merge_bitmaps properties ------------------------------------------------


@given(bits=st.lists(st.booleans(), max_size=200), policy=st.sampled_from(list(TrimPolicy)))
def test_select_retained_matches_the_model(bits, policy):
    found = to_bitmap(bits)
    kept = select_retained(found, len(bits), policy)
    if policy is TrimPolicy.PREFIX:
        lead = next((i for i, b in enumerate(bits) if not b), len(bits))
        assert kept.to_numpy().tolist() == [i < lead for i in range(len(bits))]
    else:
        assert kept.to_numpy().tolist() == bits
    assert (kept & found) == kept


@given(
    maps=st.lists(st.lists(st.booleans(), max_size=90), max_size=4),
    n=st.integers(0, 80),
)
def test_merge_bitmaps_is_an_or_with_zero_extension(maps, n):
    merged = merge_bitmaps([to_bitmap(m) for m in maps], n)
    assert len(merged) == n and tail_is_clear(merged)
    assert merged.to_numpy().tolist() == [any(i < len(m) and m[i] for m in maps) for i in range(n)]
    assert merged.highest_set_bit() < n
