"""The Bitmap type: construction, conversion, bit access, queries, operators,
value semantics, and every operation against a plain-Python model (a list of
bools and the Python int with the same bits)."""

from __future__ import annotations

import copy
import pickle

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

import hmem
from hmem import Bitmap, InvalidArgumentError, merge_bitmaps

# ---- the model ----------------------------------------------------------------


def model_int(bits: list[bool]) -> int:
    return sum(1 << i for i, b in enumerate(bits) if b)


def model_bytes(bits: list[bool]) -> bytes:
    return model_int(bits).to_bytes((len(bits) + 7) // 8, "little")


def model_runs(bits: list[bool]) -> list[tuple[int, int]]:
    runs, start = [], None
    for i, b in enumerate(bits + [False]):
        if b and start is None:
            start = i
        elif not b and start is not None:
            runs.append((start, i))
            start = None
    return runs


def model_leading(bits: list[bool], value: bool) -> int:
    n = 0
    for b in bits:
        if b != value:
            break
        n += 1
    return n


def model_highest(bits: list[bool]) -> int:
    return max((i for i, b in enumerate(bits) if b), default=-1)


def from_model(bits: list[bool]) -> Bitmap:
    return Bitmap.from_numpy(np.array(bits, dtype=np.bool_).reshape(-1))


def tail_is_clear(bm: Bitmap) -> bool:
    """No bit at or past len(bm) is set in the packed bytes."""
    data = bm.to_bytes()
    if len(data) != (len(bm) + 7) // 8:
        return False
    return int.from_bytes(data, "little") >> len(bm) == 0


def assert_matches(bm: Bitmap, bits: list[bool]) -> None:
    """Every query of `bm` agrees with the model `bits`."""
    n = len(bits)
    assert len(bm) == n
    assert bm.to_bytes() == model_bytes(bits)
    assert tail_is_clear(bm)
    arr = bm.to_numpy()
    assert arr.dtype == np.bool_ and arr.shape == (n,)
    assert arr.tolist() == bits
    idx = bm.indices()
    assert idx.dtype == np.int64
    assert idx.tolist() == [i for i, b in enumerate(bits) if b]
    assert bm.runs() == model_runs(bits)
    assert bm.popcount() == sum(bits)
    assert bm.leading_ones() == model_leading(bits, True)
    assert bm.leading_zeros() == model_leading(bits, False)
    assert bm.highest_set_bit() == model_highest(bits)
    assert bm.any() == any(bits)
    assert [bm.test(i) for i in range(n)] == bits
    assert [bm[i] for i in range(n)] == bits


# ---- strategies -------------------------------------------------------------------


@st.composite
def bit_lists(draw, min_size: int = 0, max_size: int = 300, long_runs_max: int = 1500):
    """Random bits, or alternating runs (long ones cross the 512-bit fast paths)."""
    mode = draw(st.sampled_from(["random", "runs", "runs"]))
    if mode == "random":
        return draw(st.lists(st.booleans(), min_size=min_size, max_size=max_size))
    n = draw(st.integers(min_size, max(min_size, long_runs_max)))
    out: list[bool] = []
    value = draw(st.booleans())
    while len(out) < n:
        run = draw(st.integers(1, max(1, n)))
        out.extend([value] * min(run, n - len(out)))
        value = not value
    return out


@st.composite
def bit_list_pairs(draw, max_size: int = 300):
    a = draw(bit_lists(max_size=max_size, long_runs_max=max_size))
    b = draw(st.lists(st.booleans(), min_size=len(a), max_size=len(a)))
    return a, b


# ---- construction ---------------------------------------------------------------

LENGTHS = [0, 1, 7, 8, 9, 13, 63, 64, 65, 100, 513, 1031]


def test_empty_bitmap():
    bm = Bitmap()
    assert len(bm) == 0
    assert bm.to_bytes() == b""
    assert bm.to_numpy().shape == (0,)
    assert bm.indices().tolist() == []
    assert bm.runs() == []
    assert bm.popcount() == 0
    assert bm.highest_set_bit() == -1
    assert bm.leading_ones() == 0 and bm.leading_zeros() == 0
    assert not bm.any()
    assert bm == Bitmap(0) == Bitmap.zeros(0) == Bitmap.ones(0)


@pytest.mark.parametrize("n", LENGTHS)
def test_zeros_ones_prefix(n):
    assert_matches(Bitmap(n), [False] * n)
    assert_matches(Bitmap.zeros(n), [False] * n)
    assert_matches(Bitmap.ones(n), [True] * n)
    for count in {0, n // 3, n}:
        assert_matches(Bitmap.prefix(n, count), [True] * count + [False] * (n - count))


def test_length_accepts_numpy_integers():
    assert len(Bitmap(np.int64(11))) == 11
    assert Bitmap.prefix(np.uint8(9), np.int32(4)).indices().tolist() == [0, 1, 2, 3]


@pytest.mark.parametrize("bad", [-1, -100, 2.0, "8", None])
def test_bad_lengths_are_refused(bad):
    with pytest.raises(InvalidArgumentError):
        Bitmap(bad)
    with pytest.raises(InvalidArgumentError):
        Bitmap.ones(bad)


def test_prefix_count_errors():
    with pytest.raises(InvalidArgumentError, match="count must be between 0 and 8, got 9"):
        Bitmap.prefix(8, 9)
    with pytest.raises(InvalidArgumentError):
        Bitmap.prefix(8, -1)


def test_from_bytes_default_length():
    bm = Bitmap.from_bytes(b"\x05\x80")
    assert len(bm) == 16
    assert bm.indices().tolist() == [0, 2, 15]
    assert bm.to_bytes() == b"\x05\x80"


def test_from_bytes_with_nbits_ignores_bits_past_the_length():
    bm = Bitmap.from_bytes(b"\xff\xff", 13)
    assert len(bm) == 13
    assert bm.popcount() == 13
    assert bm.highest_set_bit() == 12
    assert bm.to_bytes() == b"\xff\x1f"
    assert bm == Bitmap.ones(13)
    assert (~bm).popcount() == 0


@pytest.mark.parametrize("source", [bytes, bytearray, memoryview])
def test_from_bytes_accepts_byte_buffers_and_copies(source):
    raw = bytearray(b"\x0f\x0f")
    bm = Bitmap.from_bytes(source(raw), 12)
    raw[0] = 0
    assert bm.indices().tolist() == [0, 1, 2, 3, 8, 9, 10, 11]


@pytest.mark.parametrize(
    "data, nbits",
    [(b"\x00\x00", 17), (b"\x00", 9), (b"\x00\x00", 8), (b"\x00", 0), (b"", 1), (b"\x00" * 3, 8)],
)
def test_from_bytes_wrong_length_is_refused(data, nbits):
    with pytest.raises(InvalidArgumentError, match="bytes"):
        Bitmap.from_bytes(data, nbits)


def test_from_bytes_negative_nbits_is_refused():
    with pytest.raises(InvalidArgumentError):
        Bitmap.from_bytes(b"", -1)


def test_from_numpy_bool_and_01_integers():
    bits = [True, False, True, True, False, False, False, False, False, True]
    assert_matches(Bitmap.from_numpy(np.array(bits)), bits)
    for dtype in (np.uint8, np.int8, np.int32, np.int64, np.uint64):
        assert_matches(Bitmap.from_numpy(np.array(bits, dtype=dtype)), bits)
    assert_matches(Bitmap.from_numpy([1, 0, 1]), [True, False, True])
    assert_matches(Bitmap.from_numpy(np.zeros(0, dtype=np.int64)), [])
    # a strided view is read correctly
    strided = np.array([1, 9, 0, 9, 1, 9], dtype=np.int64)[::2]
    assert_matches(Bitmap.from_numpy(strided), [True, False, True])


@pytest.mark.parametrize(
    "arr",
    [
        np.zeros((2, 3), dtype=np.bool_),
        np.zeros((1, 8), dtype=np.uint8),
        np.array(True),
        np.array([0, 1, 2]),
        np.array([0, -1]),
        np.array([0.0, 1.0]),
        np.array(["0", "1"]),
    ],
)
def test_from_numpy_refuses_other_shapes_and_values(arr):
    with pytest.raises(InvalidArgumentError):
        Bitmap.from_numpy(arr)


def test_from_indices():
    assert_matches(Bitmap.from_indices([0, 3, 3, 9], 10), [i in (0, 3, 9) for i in range(10)])
    assert_matches(Bitmap.from_indices([], 5), [False] * 5)
    assert_matches(Bitmap.from_indices(np.array([12], dtype=np.uint16), 13), [False] * 12 + [True])
    assert_matches(Bitmap.from_indices(iter([1, 2]), 3), [False, True, True])


@pytest.mark.parametrize("indices, nbits", [([10], 10), ([-1], 10), ([0, 99], 10), ([0], 0)])
def test_from_indices_out_of_range_is_refused(indices, nbits):
    with pytest.raises(InvalidArgumentError, match="outside"):
        Bitmap.from_indices(indices, nbits)


@pytest.mark.parametrize("indices", [[1.5], [[1, 2]], np.array([0.0])])
def test_from_indices_refuses_non_integers(indices):
    with pytest.raises(InvalidArgumentError):
        Bitmap.from_indices(indices, 8)


# ---- bit access ---------------------------------------------------------------------


def test_test_set_clear():
    bm = Bitmap(13)
    bm.set(0)
    bm.set(12)
    bm.set(12)
    assert bm.indices().tolist() == [0, 12]
    assert bm.test(12) and bm[0] and not bm.test(5)
    bm.clear(0)
    bm.clear(5)
    assert bm.indices().tolist() == [12]
    assert bm.to_bytes() == b"\x00\x10"


@pytest.mark.parametrize("n", [0, 1, 8, 13])
def test_index_errors(n):
    bm = Bitmap(n)
    for bad in (n, n + 1, -1, -n - 1):
        with pytest.raises(IndexError):
            bm.test(bad)
        with pytest.raises(IndexError):
            bm[bad]
        with pytest.raises(IndexError):
            bm.set(bad)
        with pytest.raises(IndexError):
            bm.clear(bad)
    assert bm == Bitmap(n)


def test_set_range_and_clear_range():
    bm = Bitmap(20)
    bm.set_range(3, 17)
    assert bm.runs() == [(3, 17)]
    bm.clear_range(5, 9)
    assert bm.runs() == [(3, 5), (9, 17)]
    bm.set_range(0, 0)
    bm.clear_range(20, 20)
    assert bm.runs() == [(3, 5), (9, 17)]
    bm.set_range(0, 20)
    assert bm == Bitmap.ones(20)
    bm.clear_range(0, 20)
    assert bm == Bitmap(20)


@pytest.mark.parametrize("start, end", [(5, 4), (0, 21), (-1, 3), (21, 21)])
def test_range_errors(start, end):
    bm = Bitmap.prefix(20, 10)
    with pytest.raises(IndexError):
        bm.set_range(start, end)
    with pytest.raises(IndexError):
        bm.clear_range(start, end)
    assert bm == Bitmap.prefix(20, 10)


# ---- queries ----------------------------------------------------------------------------


def test_queries_on_examples():
    bm = Bitmap.from_indices([0, 1, 2, 5, 9], 10)
    assert bm.popcount() == 5
    assert bm.leading_ones() == 3
    assert bm.leading_zeros() == 0
    assert bm.highest_set_bit() == 9
    assert bm.runs() == [(0, 3), (5, 6), (9, 10)]
    late = Bitmap.from_indices([70], 100)
    assert late.leading_zeros() == 70 and late.leading_ones() == 0 and late.highest_set_bit() == 70
    assert Bitmap(100).highest_set_bit() == -1
    assert Bitmap(100).leading_zeros() == 100
    assert Bitmap.ones(100).leading_ones() == 100


# ---- operators ---------------------------------------------------------------------------


def test_binary_operators_on_examples():
    a = Bitmap.from_indices([0, 1, 2, 9], 10)
    b = Bitmap.from_indices([1, 2, 3, 8], 10)
    assert (a & b).indices().tolist() == [1, 2]
    assert (a | b).indices().tolist() == [0, 1, 2, 3, 8, 9]
    assert (a ^ b).indices().tolist() == [0, 3, 8, 9]
    # operands are not modified
    assert a.indices().tolist() == [0, 1, 2, 9]
    assert b.indices().tolist() == [1, 2, 3, 8]


def test_invert_never_sets_tail_bits():
    inv = ~Bitmap(13)
    assert inv.popcount() == 13
    assert inv.to_bytes()[-1] == 0x1F
    assert inv.highest_set_bit() == 12
    assert inv == Bitmap.ones(13)
    assert ~inv == Bitmap(13)
    assert (~Bitmap.from_indices([0, 12], 13)).indices().tolist() == list(range(1, 12))


@pytest.mark.parametrize("op", ["__and__", "__or__", "__xor__"])
@pytest.mark.parametrize("m", [12, 14, 0, 16])
def test_mismatched_lengths_are_refused(op, m):
    a, b = Bitmap.ones(13), Bitmap.ones(m)
    with pytest.raises(InvalidArgumentError, match="different lengths") as info:
        getattr(a, op)(b)
    assert isinstance(info.value, ValueError)
    assert "13" in str(info.value) and str(m) in str(info.value)


def test_binary_operator_with_non_bitmap_is_a_type_error():
    with pytest.raises(TypeError):
        Bitmap(8) & b"\x00"
    with pytest.raises(TypeError):
        Bitmap(8) | 0
    with pytest.raises(TypeError):
        Bitmap(8) ^ [0] * 8


# ---- value semantics ----------------------------------------------------------------------------


def test_equality_by_value():
    a = Bitmap.from_indices([1, 4], 9)
    b = Bitmap(9)
    b.set(4)
    b.set(1)
    assert a == b and not (a != b)
    assert a == a.copy()
    b.clear(1)
    assert a != b
    # same bytes, different lengths
    assert Bitmap(8) != Bitmap(9)
    assert Bitmap.ones(8) != Bitmap.ones(8).resized(9)
    assert Bitmap(8) != b"\x00"
    assert Bitmap(0) != 0


def test_unhashable():
    with pytest.raises(TypeError):
        hash(Bitmap(8))
    with pytest.raises(TypeError):
        {Bitmap(8)}


@pytest.mark.parametrize("protocol", range(pickle.HIGHEST_PROTOCOL + 1))
@pytest.mark.parametrize("n", [0, 1, 13, 64, 1000])
def test_pickle_round_trip(protocol, n):
    bm = Bitmap.from_indices([i for i in range(n) if i % 3 == 0], n)
    back = pickle.loads(pickle.dumps(bm, protocol=protocol))
    assert back == bm
    assert back is not bm and back.buffer is not bm.buffer
    assert len(back) == n and tail_is_clear(back)
    assert copy.deepcopy(bm) == bm
    assert copy.copy(bm) == bm


def test_copy_is_independent_and_buffer_is_shared():
    bm = Bitmap.prefix(16, 4)
    dup = bm.copy()
    dup.set(10)
    assert bm.indices().tolist() == [0, 1, 2, 3]
    bm.buffer[1] = 0x01
    assert bm.test(8)


@pytest.mark.parametrize(
    "bm, text",
    [
        (Bitmap.from_indices([0, 1, 2, 5], 10), "Bitmap(10, {0-2, 5})"),
        (Bitmap(0), "Bitmap(0, {})"),
        (Bitmap(7), "Bitmap(7, {})"),
        (Bitmap.ones(13), "Bitmap(13, {0-12})"),
        (Bitmap.from_indices([3, 4], 5), "Bitmap(5, {3-4})"),
    ],
)
def test_repr_is_readable(bm, text):
    assert repr(bm) == text


def test_repr_of_many_runs_is_cut():
    bm = Bitmap.from_indices(range(0, 40, 2), 40)  # 20 runs of one bit
    text = repr(bm)
    assert text.startswith("Bitmap(40, {0, 2, 4, 6, 8, 10, 12, 14, ")
    assert "(20 set in 20 runs)" in text
    assert "16" not in text


def test_resized():
    bm = Bitmap.ones(20)
    cut = bm.resized(13)
    assert len(cut) == 13 and cut.to_bytes() == b"\xff\x1f" and cut.popcount() == 13
    grown = cut.resized(30)
    assert len(grown) == 30 and grown.indices().tolist() == list(range(13))
    assert bm.resized(20) == bm and bm.resized(20) is not bm
    assert bm.resized(0) == Bitmap(0)
    with pytest.raises(InvalidArgumentError):
        bm.resized(-1)


# ---- regression: no bit past the length, ever ------------------------------------------------------


def test_merge_with_a_longer_map_reports_no_bit_past_the_length():
    # The known defect: OR-ing a longer map into an N-bit result leaked its
    # bits past N into the last byte, so highest_set_bit reported >= N.
    longer = Bitmap.ones(20)
    merged = merge_bitmaps([Bitmap(13), longer], 13)
    assert len(merged) == 13
    assert merged.highest_set_bit() == 12
    assert merged.popcount() == 13
    assert merged.to_bytes() == b"\xff\x1f"
    assert merged == Bitmap.ones(13)
    only_tail = merge_bitmaps([Bitmap.from_indices([13, 14, 15, 19], 20)], 13)
    assert only_tail.highest_set_bit() == -1
    assert only_tail.popcount() == 0
    assert only_tail.runs() == [] and not only_tail.any()
    assert (~only_tail).popcount() == 13


@given(bits=bit_lists(max_size=200, long_runs_max=600), garbage=st.integers(0, 255), data=st.data())
def test_no_operation_reports_a_bit_past_the_length(bits, garbage, data):
    n = len(bits)
    # the input bytes carry garbage in the pad bits of the last byte
    raw = bytearray(model_bytes(bits))
    if n % 8:
        raw[-1] |= garbage & ~((1 << (n % 8)) - 1) & 0xFF
    bm = Bitmap.from_bytes(bytes(raw), n)
    assert_matches(bm, bits)
    other = from_model(data.draw(st.lists(st.booleans(), min_size=n, max_size=n)))
    m = data.draw(st.integers(0, n + 20))
    results = [
        ~bm,
        bm & other,
        bm | other,
        bm ^ other,
        bm.copy(),
        bm.resized(m),
        merge_bitmaps([bm, Bitmap.ones(n + 9)], n),
        merge_bitmaps([Bitmap.ones(n + 9)], m),
        pickle.loads(pickle.dumps(bm)),
    ]
    for res in results:
        assert tail_is_clear(res)
        assert res.highest_set_bit() < len(res)
        assert res.popcount() == len(res.indices()) <= len(res)
        assert all(end <= len(res) for _, end in res.runs())


# ---- properties against the model ---------------------------------------------------------------


@given(bits=bit_lists())
@example(bits=[True] * 13)
@example(bits=[False] * 511 + [True])
@example(bits=[True] * 1024 + [False] + [True] * 7)
def test_queries_match_the_model(bits):
    bm = from_model(bits)
    assert_matches(bm, bits)
    assert Bitmap.from_bytes(bm.to_bytes(), len(bits)) == bm
    assert Bitmap.from_numpy(bm.to_numpy()) == bm
    assert Bitmap.from_indices(bm.indices(), len(bits)) == bm
    assert Bitmap.from_numpy(np.array(bits, dtype=np.uint8)) == bm
    assert pickle.loads(pickle.dumps(bm)) == bm
    rebuilt = Bitmap(len(bits))
    for a, b in bm.runs():
        rebuilt.set_range(a, b)
    assert rebuilt == bm


@given(pair=bit_list_pairs())
def test_operators_match_the_model(pair):
    a, b = pair
    x, y = from_model(a), from_model(b)
    assert_matches(x & y, [p and q for p, q in zip(a, b)])
    assert_matches(x | y, [p or q for p, q in zip(a, b)])
    assert_matches(x ^ y, [p != q for p, q in zip(a, b)])
    assert_matches(~x, [not p for p in a])
    assert (x == y) == (a == b)
    assert (x & y) == (y & x) and (x | y) == (y | x)
    assert (x ^ y) ^ y == x
    assert ~(x & y) == (~x | ~y)
    # the operands are untouched
    assert_matches(x, a)
    assert_matches(y, b)


@given(bits=bit_lists(max_size=200, long_runs_max=600), data=st.data())
def test_resized_matches_the_model(bits, data):
    m = data.draw(st.integers(0, len(bits) + 40))
    res = from_model(bits).resized(m)
    assert_matches(res, (bits + [False] * m)[:m])


@given(bits=bit_lists(max_size=200, long_runs_max=700), data=st.data())
def test_range_writes_match_the_model(bits, data):
    n = len(bits)
    start = data.draw(st.integers(0, n))
    end = data.draw(st.integers(start, n))
    bm = from_model(bits)
    bm.set_range(start, end)
    set_model = [b or start <= i < end for i, b in enumerate(bits)]
    assert_matches(bm, set_model)
    bm = from_model(bits)
    bm.clear_range(start, end)
    assert_matches(bm, [b and not start <= i < end for i, b in enumerate(bits)])


@given(bits=bit_lists(max_size=120, long_runs_max=300), data=st.data())
def test_merge_bitmaps_matches_the_model(bits, data):
    n = len(bits)
    others = data.draw(st.lists(st.lists(st.booleans(), max_size=n + 20), max_size=3))
    maps = [bits] + others
    merged = merge_bitmaps([from_model(m) for m in maps], n)
    expected = [any(i < len(m) and m[i] for m in maps) for i in range(n)]
    assert_matches(merged, expected)
    assert_matches(merge_bitmaps([], n), [False] * n)


# ---- a state machine: a long life of mutations ------------------------------------------------------


class BitmapMachine(RuleBasedStateMachine):
    """Mutate one Bitmap and a list-of-bools model side by side."""

    @initialize(bits=bit_lists(max_size=150, long_runs_max=700))
    def start(self, bits):
        self.model = list(bits)
        self.bm = from_model(bits)

    def _index(self, data):
        return data.draw(st.integers(0, len(self.model) - 1))

    @rule(data=st.data())
    def set_bit(self, data):
        if self.model:
            i = self._index(data)
            self.bm.set(i)
            self.model[i] = True

    @rule(data=st.data())
    def clear_bit(self, data):
        if self.model:
            i = self._index(data)
            self.bm.clear(i)
            self.model[i] = False

    @rule(data=st.data(), value=st.booleans())
    def write_range(self, data, value):
        n = len(self.model)
        a = data.draw(st.integers(0, n))
        b = data.draw(st.integers(a, n))
        (self.bm.set_range if value else self.bm.clear_range)(a, b)
        self.model[a:b] = [value] * (b - a)

    @rule()
    def invert(self):
        self.bm = ~self.bm
        self.model = [not b for b in self.model]

    @rule(data=st.data(), op=st.sampled_from(["and", "or", "xor"]))
    def combine(self, data, op):
        other = data.draw(st.lists(st.booleans(), min_size=len(self.model), max_size=len(self.model)))
        ob = from_model(other)
        if op == "and":
            self.bm, self.model = self.bm & ob, [p and q for p, q in zip(self.model, other)]
        elif op == "or":
            self.bm, self.model = self.bm | ob, [p or q for p, q in zip(self.model, other)]
        else:
            self.bm, self.model = self.bm ^ ob, [p != q for p, q in zip(self.model, other)]

    @rule(data=st.data())
    def resize(self, data):
        m = data.draw(st.integers(0, len(self.model) + 30))
        self.bm = self.bm.resized(m)
        self.model = (self.model + [False] * m)[:m]

    @rule()
    def round_trip(self):
        self.bm = pickle.loads(pickle.dumps(self.bm))

    @invariant()
    def agrees_with_model(self):
        if hasattr(self, "bm"):
            assert_matches(self.bm, self.model)


TestBitmapMachine = BitmapMachine.TestCase
TestBitmapMachine.settings = settings(
    settings.default, max_examples=max(10, settings.default.max_examples // 3), stateful_step_count=15
)


def test_public_name():
    assert hmem.Bitmap is Bitmap
    assert issubclass(hmem.InvalidArgumentError, ValueError)
