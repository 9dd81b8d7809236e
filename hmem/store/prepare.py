"""What a put is given, checked and converted before anything is stored
(hmem/store/writer.py stores it): keys and values as float32 rows of the
store's width, the layer and importance in range, the signatures and pooled
keys computed (one kernel call for the batch), the rows encoded in the
storage dtype (overflow refused) and the metadata as bounded JSON.  A batch
is checked whole first, so one bad entry stores nothing."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable, Mapping
from typing import Any, NamedTuple

import numpy as np

from hmem import kernels, memory, validation
from hmem.errors import InvalidArgumentError, InvalidTensorError
from hmem.formats import shard_file
from hmem.store import storage as storage_codec
from hmem.store.state import StoreState
from hmem.store.tensors import as_rows


class Entry(NamedTuple):
    """One put of a batch (``Store.put_many``)."""

    keys: Any
    values: Any
    layer_idx: int = 0
    importance: float = 1.0
    meta: Mapping[str, Any] | None = None  # a small JSON object kept with the entry (source, chunk, tokens)


@dataclasses.dataclass
class PreparedBatch:
    """Checked puts, ready to be stored, held column by column so that
    storing them takes array operations, not a Python step per entry.  It
    keeps only what goes into the shard, in arrays of its own (the caller
    may change its arrays afterwards)."""

    n_tokens: np.ndarray  # int64 [n]
    starts: np.ndarray  # int64 [n + 1]: entry e's rows are starts[e] .. starts[e + 1] - 1 of rows[kind]
    layer_idx: np.ndarray  # int64 [n]
    importance: np.ndarray  # float64 [n]
    signatures: np.ndarray  # uint8 [n, hdc_dim / 8]
    # float32 [n, signatures_per_entry x embed_dim]: the mean key, then each span's mean
    pooled: np.ndarray
    # "k", "v" in the storage dtype; int8 also "ks", "vs" (scales): pieces
    # whose rows, back to back, are every entry's rows: one piece (`joined`)
    # or one per entry
    rows: dict[str, list[np.ndarray]]
    joined: bool
    meta: dict[int, str]  # position in the batch -> the entry's metadata as JSON (most have none)
    buffers: list[np.ndarray]  # memory.POOL buffers that rows[...] may view
    spans: np.ndarray | None = None  # uint8 [n, spans, span bytes]: span signatures (None: the store keeps none)

    def __len__(self) -> int:
        return len(self.n_tokens)

    def release(self) -> None:
        """Give the batch's buffers back to the pool once what it holds is
        stored (copied into the open shard) or dropped: the batch's rows are
        not to be read afterwards."""
        buffers, self.buffers, self.rows = self.buffers, [], {}
        for buffer in buffers:
            memory.POOL.give(buffer)


_F32 = np.dtype(np.float32)
# Entries of at least this many bytes of keys on average are prepared one by one (_converted).
LARGE_ENTRY_BYTES = 64 << 10


def prepare_all(state: StoreState, entries: Iterable[Entry | tuple], *, single: bool = False) -> PreparedBatch:
    """Every entry checked and converted; the first bad one raises, naming
    it (unless `single`: the one entry of a put).  A batch of small entries
    all in the common form (tuples or Entry of float32 rows) is scanned and
    joined natively (_common_form); otherwise, per entry, Python only
    unpacks it and checks types and shapes.  Values are checked and
    converted for the whole batch at once."""
    if not single:
        items = entries if type(entries) is list else list(entries)
        batch = _common_form(state, items)
        if batch is not None:
            return batch
        entries = items
    dim = state.config.embed_dim
    keys: list[np.ndarray] = []
    values: list[np.ndarray] = []
    tokens: list[int] = []
    layers: list[int] = []
    weights: list[float] = []
    metas: dict[int, str] = {}
    words = False  # some entries are bfloat16 words (storage.Bf16Rows)
    for i, item in enumerate(entries):
        if type(item) is tuple and len(item) == 4:  # the common form, unpacked without building an Entry
            k, v, layer, imp = item
            meta = None
        else:
            try:
                k, v, layer, imp, meta = Entry(*item)
            except TypeError:
                raise InvalidArgumentError(
                    f"entry {i}: expected (keys, values[, layer_idx[, importance]]), got {type(item).__name__}"
                ) from None
        try:
            if not (
                type(k) is np.ndarray
                and type(v) is np.ndarray
                and k.dtype is _F32
                and v.dtype is _F32
                and k.ndim == 2
                and k.shape == v.shape
                and k.shape[1] == dim
                and 0 < k.shape[0] <= validation.U32_MAX
            ):
                if type(k) is storage_codec.Bf16Rows or type(v) is storage_codec.Bf16Rows:
                    _check_bf16_rows(k, v, dim)  # kept as words until _converted
                    words = True
                else:
                    k, v = _checked_rows(k, v, dim)  # converts, or raises with the reason
            if type(layer) is not int or not 0 <= layer <= validation.U32_MAX:
                layer = validation.layer_index(layer)
            if type(imp) is not float or not 0.0 <= imp <= validation.F32_MAX:
                imp = validation.importance(imp)
            if meta is not None:
                metas[i] = _meta_json(meta)
        except InvalidArgumentError as exc:
            if single:
                raise
            raise type(exc)(f"entry {i}: {exc.message}", hint=exc.hint) from None
        keys.append(k)
        values.append(v)
        tokens.append(k.shape[0])
        layers.append(layer)
        weights.append(imp)
    n_tokens = np.array(tokens, dtype=np.int64)
    buffers: list[np.ndarray] = []
    try:
        return _converted(state, keys, values, n_tokens, layers, weights, metas, buffers, single, words)
    except BaseException:
        for buffer in buffers:
            memory.POOL.give(buffer)
        raise


def _common_form(state: StoreState, items: list) -> PreparedBatch | None:
    """The batch prepared when its entries are small and every one is a
    plain tuple (keys, values, layer_idx, importance) or an Entry without
    meta, of C-contiguous float32 rows [n, embed_dim], an int layer and a
    float importance, all in range: the scan and the join of the rows are
    one native call each (the entries kernels), with no Python step per
    entry.  None otherwise: the general path then takes the batch (and
    names what is wrong)."""
    n, dim = len(items), state.config.embed_dim
    if not n:
        return None
    tokens = np.empty(n, dtype=np.int64)
    layers = np.empty(n, dtype=np.int64)
    weights = np.empty(n, dtype=np.float64)
    if (
        kernels.entries.scan_entries(
            items, dim, validation.U32_MAX, validation.U32_MAX, validation.F32_MAX, tokens, layers, weights, Entry
        )
        != n
    ):
        return None
    starts = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(tokens, out=starts[1:])
    total = int(starts[-1])
    if total * dim * 4 >= LARGE_ENTRY_BYTES * n:
        return None  # large entries are taken one by one, without joining (_one_by_one)
    buffers: list[np.ndarray] = []
    try:
        k_rows, v_rows = _pool_rows(total, dim, buffers), _pool_rows(total, dim, buffers)
        kernels.entries.join_rows(items, starts, k_rows, v_rows, Entry)
        return _from_joined(state, k_rows, v_rows, tokens, starts, layers, weights, {}, buffers, False)
    except BaseException:
        for buffer in buffers:
            memory.POOL.give(buffer)
        raise


def _converted(
    state: StoreState,
    keys: list[np.ndarray],
    values: list[np.ndarray],
    n_tokens: np.ndarray,
    layers: list[int],
    weights: list[float],
    metas: dict[int, str],
    buffers: list[np.ndarray],
    single: bool,
    words: bool = False,
) -> PreparedBatch:
    """The batch of entries whose types and shapes are checked: rows
    checked and encoded, signatures and pooled keys computed.  Small
    entries are joined into pool buffers (listed in `buffers`) and
    converted in whole-batch operations; large ones (LARGE_ENTRY_BYTES and
    more on average) are taken one by one, where the per-entry Python cost
    is small against their size and joining would be one more copy."""
    dim = state.config.embed_dim
    starts = np.zeros(len(n_tokens) + 1, dtype=np.int64)
    np.cumsum(n_tokens, out=starts[1:])
    if len(n_tokens) and int(starts[-1]) * dim * 4 >= LARGE_ENTRY_BYTES * len(n_tokens):
        return _one_by_one(state, keys, values, n_tokens, starts, layers, weights, metas, single)
    if words:  # small entries given as bfloat16 words are joined as float32 rows
        keys = [k.widened() if type(k) is storage_codec.Bf16Rows else k for k in keys]
        values = [v.widened() if type(v) is storage_codec.Bf16Rows else v for v in values]
    k_rows = _joined(keys, int(starts[-1]), dim, buffers)
    v_rows = _joined(values, int(starts[-1]), dim, buffers)
    return _from_joined(state, k_rows, v_rows, n_tokens, starts, layers, weights, metas, buffers, single)


def _from_joined(
    state: StoreState,
    k_rows: np.ndarray,
    v_rows: np.ndarray,
    n_tokens: np.ndarray,
    starts: np.ndarray,
    layers: Any,
    weights: Any,
    metas: dict[int, str],
    buffers: list[np.ndarray],
    single: bool,
) -> PreparedBatch:
    """The batch whose rows are joined (entry e's at starts[e] ..
    starts[e + 1] - 1): values checked and encoded, signatures and pooled
    keys computed."""
    dim = state.config.embed_dim
    rows = {}
    for kind, joined, what in (("k", k_rows, "keys"), ("v", v_rows, "values")):
        bad = _first_nonfinite_row(joined)
        if bad is not None:
            entry = int(np.searchsorted(starts, bad, side="right")) - 1
            raise _naming_entry(InvalidTensorError(f"{what} holds NaN or infinite values"), entry, single)
        try:
            encoded = storage_codec.encode(joined, state.config.storage_dtype, what)
        except InvalidTensorError as exc:
            raise _naming_entry(exc, _first_failing(joined, starts, state.config.storage_dtype, what), single) from None
        for suffix, array in encoded.items():
            rows[kind + suffix] = [array]
    if len(n_tokens):  # the signatures are copied into the records when stored, the means into `pooled` below
        signatures, means = state.projector.signatures_and_means(k_rows, starts, buffers)
    else:
        signatures = np.zeros((0, state.config.signature_bytes), dtype=np.uint8)
        means = np.zeros((0, dim))
    spans, pooled = _with_spans(state, k_rows, starts, means)
    return PreparedBatch(
        n_tokens,
        starts,
        np.array(layers, dtype=np.int64),
        np.array(weights, dtype=np.float64),
        signatures,
        pooled,
        rows,
        True,
        metas,
        buffers,
        spans,
    )


def _with_spans(
    state: StoreState, k_rows: np.ndarray, starts: np.ndarray, means: np.ndarray
) -> tuple[np.ndarray | None, np.ndarray]:
    """(span signatures or None, pooled keys float32 [n, signatures_per_entry
    x embed_dim]) of entries whose mean keys are `means`."""
    if state.span_projector is None:
        return None, means.astype(np.float32)
    spans, span_means = state.span_projector.signatures_and_means(k_rows, starts)
    pooled = np.concatenate([means[:, None, :], span_means], axis=1).astype(np.float32)
    return spans, pooled.reshape(len(means), -1)


def _one_by_one(
    state: StoreState,
    keys: list[np.ndarray],
    values: list[np.ndarray],
    n_tokens: np.ndarray,
    starts: np.ndarray,
    layers: list[int],
    weights: list[float],
    metas: dict[int, str],
    single: bool,
) -> PreparedBatch:
    """_converted for large entries, entry by entry, without joining their rows."""
    storage = state.config.storage_dtype
    rows: dict[str, list[np.ndarray]] = {}
    signatures, means = [], []
    spans: list[np.ndarray] = []
    pooled_keys: list[np.ndarray] = []
    key_scratch, value_scratch = _Scratch(), _Scratch()
    # bfloat16 words that the store keeps as words or widens into its shard
    # need no float32 rows here: their token sums give the check and the signature
    sums_only = storage in ("f32", "bf16") and state.span_projector is None
    for e, (k, v) in enumerate(zip(keys, values)):
        if type(k) is storage_codec.Bf16Rows and sums_only:
            key_sums = _finite_token_sums(k, "keys", e, single)
            _finite_token_sums(v, "values", e, single)
            for kind, rows_in in (("k", k), ("v", v)):
                rows.setdefault(kind, []).append(
                    rows_in.words() if storage == "bf16" else storage_codec.WideningRows(rows_in)
                )
            signatures.append(state.projector.signature_of_sum(key_sums))
            means.append(key_sums / k.shape[0])
            continue
        if type(k) is storage_codec.Bf16Rows:
            k = _stored_bf16(storage, k, "k", "keys", rows, e, single, key_scratch)
            _stored_bf16(storage, v, "v", "values", rows, e, single, value_scratch)
        else:
            k, v = np.ascontiguousarray(k), np.ascontiguousarray(v)
            for kind, array, what in (("k", k, "keys"), ("v", v, "values")):
                if _first_nonfinite_row(array) is not None:
                    raise _naming_entry(InvalidTensorError(f"{what} holds NaN or infinite values"), e, single)
                _store_encoded(storage, array, kind, what, rows, e, single)
        signature, mean = state.projector.signature_and_mean(k)
        signatures.append(signature)
        means.append(mean)
        if state.span_projector is not None:
            span_sigs, pooled = _with_spans(state, k, np.array([0, len(k)], dtype=np.int64), mean[None, :])
            assert span_sigs is not None
            spans.append(span_sigs)
            pooled_keys.append(pooled)
    if not spans:
        return PreparedBatch(
            n_tokens,
            starts,
            np.array(layers, dtype=np.int64),
            np.array(weights, dtype=np.float64),
            np.stack(signatures),
            np.stack(means).astype(np.float32),
            rows,
            False,
            metas,
            [],
        )
    return PreparedBatch(
        n_tokens,
        starts,
        np.array(layers, dtype=np.int64),
        np.array(weights, dtype=np.float64),
        np.stack(signatures),
        np.concatenate(pooled_keys),
        rows,
        False,
        metas,
        [],
        np.concatenate(spans),
    )


class _Scratch:
    """One float32 buffer reused entry after entry for bfloat16 words
    widened to be checked, signed or encoded (what a store keeps is made
    from them): no fresh memory per entry."""

    def __init__(self) -> None:
        self.buffer = np.empty(0, dtype=np.float32)

    def rows(self, count: int) -> np.ndarray:
        if self.buffer.size < count:
            self.buffer = np.empty(count, dtype=np.float32)
        return self.buffer[:count]


def _stored_bf16(
    storage: str,
    rows_in: storage_codec.Bf16Rows,
    kind: str,
    what: str,
    rows: dict[str, list[Any]],
    entry: int,
    single: bool,
    scratch: _Scratch,
) -> np.ndarray:
    """Store bfloat16 words in `rows` as the storage dtype keeps them: the
    words themselves in a bf16 store, widened as they are copied into the
    shard in an f32 store, else widened (exactly) and encoded.  Returns the
    float32 rows, which the scratch's next use overwrites."""
    words = rows_in.words() if storage == "bf16" else rows_in.view
    wide = storage_codec.widen(words, scratch.rows(rows_in.shape[0] * rows_in.shape[1]))
    if _first_nonfinite_row(wide) is not None:  # a sum over the widened rows costs less than testing words
        raise _naming_entry(InvalidTensorError(f"{what} holds NaN or infinite values"), entry, single)
    if storage == "bf16":
        rows.setdefault(kind, []).append(words)
    elif storage == "f32":
        rows.setdefault(kind, []).append(storage_codec.WideningRows(rows_in))  # widened again into the shard
    else:
        _store_encoded(storage, wide, kind, what, rows, entry, single)
    return wide


def _finite_token_sums(rows_in: storage_codec.Bf16Rows, what: str, entry: int, single: bool) -> np.ndarray:
    """The float64 token sums of the rows of bfloat16 words, or the error
    naming NaN or infinite values.  A sum of finite bfloat16 values stays
    finite in float64 (each is below 2**128, and an entry holds fewer than
    2**32 tokens), so a nonfinite sum means a nonfinite value."""
    sums = rows_in.token_sums()
    if not np.isfinite(sums).all():
        raise _naming_entry(InvalidTensorError(f"{what} holds NaN or infinite values"), entry, single)
    return sums


def _store_encoded(
    storage: str, array: np.ndarray, kind: str, what: str, rows: dict[str, list[np.ndarray]], entry: int, single: bool
) -> None:
    try:
        encoded = storage_codec.encode(array, storage, what)
    except InvalidTensorError as exc:
        raise _naming_entry(exc, entry, single) from None
    for suffix, stored in encoded.items():
        rows.setdefault(kind + suffix, []).append(stored)


def _check_bf16_rows(keys: Any, values: Any, dim: int) -> None:
    """Keys and values given as bfloat16 words: both so, of one shape, rows of the store's width."""
    if type(keys) is not type(values):
        raise InvalidTensorError("keys and values must both be bfloat16 words or both be arrays")
    if keys.shape != values.shape:
        raise InvalidTensorError(f"keys {list(keys.shape)} and values {list(values.shape)} differ in shape")
    if keys.shape[1] != dim:
        raise InvalidTensorError(f"keys has rows of {keys.shape[1]} values; the store's embed_dim is {dim}")
    if not 0 < keys.shape[0] <= validation.U32_MAX:
        raise InvalidTensorError(f"an entry holds 1 to {validation.U32_MAX} tokens, got {keys.shape[0]}")


def prepare(
    state: StoreState, keys: Any, values: Any, layer_idx: Any, importance: Any, meta: Any = None
) -> PreparedBatch:
    """One put checked and converted; bad input raises and changes nothing."""
    return prepare_all(state, [(keys, values, layer_idx, importance, meta)], single=True)


def _checked_rows(keys: Any, values: Any, dim: int) -> tuple[np.ndarray, np.ndarray]:
    """Keys and values as float32 rows, or the error that says what is wrong."""
    k = as_rows(keys, "keys", dim)
    v = as_rows(values, "values", dim)
    if k.shape != v.shape:
        raise InvalidTensorError(f"keys {list(k.shape)} and values {list(v.shape)} differ in shape")
    if k.shape[0] > validation.U32_MAX:
        raise InvalidTensorError(f"an entry holds at most {validation.U32_MAX} tokens")
    return k, v


def _pool_rows(count: int, dim: int, buffers: list[np.ndarray]) -> np.ndarray:
    """A C-contiguous float32 [count, dim] array in a pool buffer (appended to `buffers`)."""
    buffer = memory.POOL.take(count * dim * 4)
    buffers.append(buffer)
    return buffer[: count * dim * 4].view(np.float32).reshape(count, dim)


def _joined(parts: list[np.ndarray], count: int, dim: int, buffers: list[np.ndarray]) -> np.ndarray:
    """The `count` rows of every entry back to back, in a C-contiguous
    float32 array of a pool buffer (appended to `buffers`)."""
    out = _pool_rows(count, dim, buffers)
    if parts:
        np.concatenate(parts, axis=0, out=out)  # into `out`: C order whatever the inputs' order
    return out


def _first_nonfinite_row(rows: np.ndarray) -> int | None:
    """The first row holding NaN or an infinity, if any.  A sum is
    nonfinite whenever a term is (and rarely otherwise, by overflow), so
    the exact check runs only then."""
    with np.errstate(over="ignore", invalid="ignore"):
        if np.isfinite(rows.sum(dtype=np.float32)):
            return None
    bad = ~np.isfinite(rows).all(axis=1)
    return int(np.argmax(bad)) if bad.any() else None


def _first_failing(rows: np.ndarray, starts: np.ndarray, storage: str, what: str) -> int:
    """The first entry whose rows the storage dtype refuses."""
    for e in range(len(starts) - 1):
        try:
            storage_codec.encode(rows[starts[e] : starts[e + 1]], storage, what)
        except InvalidTensorError:
            return e
    return 0


def _naming_entry(exc: InvalidArgumentError, entry: int, single: bool) -> InvalidArgumentError:
    return exc if single else type(exc)(f"entry {entry}: {exc.message}", hint=exc.hint)


def _meta_json(meta: Any) -> str:
    """An entry's metadata as compact JSON: an object of at most
    META_MAX_BYTES, its keys strings, its values numbers, strings, booleans,
    null or lists of those."""
    if not isinstance(meta, Mapping) or not all(isinstance(key, str) for key in meta):
        raise InvalidArgumentError(f"meta must be a mapping of strings, got {type(meta).__name__}")
    scalar = (str, int, float, bool, type(None))
    for key, value in meta.items():
        if not (
            isinstance(value, scalar) or isinstance(value, (list, tuple)) and all(isinstance(x, scalar) for x in value)
        ):
            raise InvalidArgumentError(f"meta[{key!r}] must be a number, a string or a list of them, got {value!r}")
    try:
        text = json.dumps(dict(meta), sort_keys=True, separators=(",", ":"), allow_nan=False)
    except ValueError:
        raise InvalidArgumentError("meta must hold finite numbers") from None
    if len(text) > shard_file.META_MAX_BYTES:
        raise InvalidArgumentError(f"meta takes {len(text)} bytes as JSON; at most {shard_file.META_MAX_BYTES}")
    return text
