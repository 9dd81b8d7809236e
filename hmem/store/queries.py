"""Similarity queries: rank a layer's entries by signature, re-rank a
shortlist by the exact cosine of pooled keys, and the best of it, when
asked, by token-level max-sim over their stored keys; count accesses
(docs/format.md, "Signatures", "Token re-rank").

With ``on_damage="skip"`` a query answers as if its layer held only the
entries it can read: an entry whose shard is missing, of the wrong size or
fails its index check, or whose tensor fails its CRC-32C, is left out, the
next best takes its place, and the query reports what it left out
(docs/reliability.md, "Degraded reads")."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple, TypeVar

import numpy as np

from hmem import validation
from hmem.config import MAX_TOKEN_RERANK
from hmem.errors import CorruptStoreError, InvalidArgumentError
from hmem.formats import store_files
from hmem.store.projection import similarity, span_bounds
from hmem.store.reading import EntryReader
from hmem.store.results import QueryResult, QueryResults, SkippedEntry, as_framework
from hmem.store.search import SEARCHES
from hmem.store.state import StoreState
from hmem.store.tensors import as_rows
from hmem.store.token_scores import max_sim

FRAMEWORKS = ("numpy", "torch")
# A span search shortlists SPAN_SHORTLIST times more entries for re-rank
# (its short span signatures pick candidates less sharply, and the exact
# re-rank over each candidate's pooled keys is cheap), and with them the
# shortlist of the whole signatures, so that a query as long as an entry
# finds what mean pooling finds (docs/benchmarks.md, "Span retrieval").
SPAN_SHORTLIST = 10
# A span's key counts in an entry's re-rank score only when the span has at
# least this share of the query's tokens: a long query is not "held" by a
# short span, and its mean is better matched by the entry's.
SPAN_MIN_SHARE = 0.5
ON_DAMAGE = ("raise", "skip")

T = TypeVar("T")


class QueryOptions(NamedTuple):
    """How a query is answered (Store.query's keyword arguments, unchecked)."""

    rerank: bool = True
    shortlist_factor: int = 4
    framework: str = "numpy"
    count_access: bool = True
    on_damage: str = "raise"
    search: str = "auto"
    token_rerank: int | None = None  # None: the store's setting


class Queries:
    """Queries over one StoreState."""

    def __init__(self, state: StoreState, reader: EntryReader) -> None:
        self.state = state
        self.reader = reader

    def query(self, query: Any, layer_idx: int, top_k: int, options: QueryOptions) -> QueryResults:
        """See Store.query."""
        rows = [as_rows(query, "query", self.state.config.embed_dim, allow_vector=True)]
        return self._run(rows, layer_idx, top_k, options)[0]

    def query_many(self, queries: Any, layer_idx: int, top_k: int, options: QueryOptions) -> list[QueryResults]:
        """See Store.query_many."""
        ndim = getattr(queries, "ndim", None)
        if ndim is not None and ndim != 3:
            # a 2-d array would be taken row by row as one-token queries
            raise InvalidArgumentError(
                f"queries must be a list of token matrices or a 3-d array, got {ndim}-d "
                f"{list(queries.shape)}: give one query in a list, or use Store.query"
            )
        if isinstance(queries, (str, bytes)) or not hasattr(queries, "__iter__"):
            raise InvalidArgumentError(f"queries must be a list of token matrices, got {type(queries).__name__}")
        embed_dim = self.state.config.embed_dim
        rows = [as_rows(q, f"queries[{i}]", embed_dim, allow_vector=True) for i, q in enumerate(queries)]
        return self._run(rows, layer_idx, top_k, options)

    def _run(self, rows: list[np.ndarray], layer_idx: int, top_k: int, options: QueryOptions) -> list[QueryResults]:
        """Answer checked queries in order.  The shortlists of all of them
        come from one scan of the layer; each is then answered exactly as a
        query of its own would be."""
        state = self.state
        layer = validation.layer_index(layer_idx)
        k = validation.top_k(top_k)
        rerank = validation.flag(options.rerank, "rerank")
        count_access = validation.flag(options.count_access, "count_access")
        framework = validation.choice(options.framework, "framework", FRAMEWORKS)
        skip = validation.choice(options.on_damage, "on_damage", ON_DAMAGE) == "skip"
        factor = validation.integer(options.shortlist_factor, "shortlist_factor", low=1) if rerank else 1
        search = validation.choice(options.search, "search", SEARCHES)
        tokens = self._token_rerank(options.token_rerank, rerank)
        n_short = max(k * factor, tokens)  # signature matches ranked again by pooled keys
        if search == "spans" and not state.config.spans:
            raise InvalidArgumentError("search='spans' needs a store with span signatures (signatures_per_entry > 1)")
        if search == "auto" and state.config.spans:
            search = "spans"
        if not rows:
            return []
        prepared = [state.projector.signature_and_mean(q) for q in rows]
        check = True if skip else None
        pooled: dict[int, np.ndarray] = {}
        kvs: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        # the query's token count for a span re-rank; None: mean keys only
        span_tokens = [len(q) if search == "spans" else None for q in rows]
        if search == "spans":  # one span scan per query (a scan of S rows per entry)
            shortlists = [self._shortlist(layer, sig, n_short, search, None, rerank, raw=True) for sig, _ in prepared]
            if len(prepared) > 1 and not tokens:
                pooled, kvs = self._read_ahead(
                    shortlists, [mean for _, mean in prepared], k, rerank, check, span_tokens
                )
        elif len(prepared) == 1:
            shortlists = [state.search_index.search(layer, prepared[0][0], n_short, search)]
        else:
            signatures = np.stack([sig for sig, _ in prepared])
            shortlists = state.search_index.search_many(layer, signatures, n_short, search)
            if not tokens:  # a token re-rank picks its results from more entries: each query reads its own
                pooled, kvs = self._read_ahead(
                    shortlists, [mean for _, mean in prepared], k, rerank, check, span_tokens
                )
        answers = [
            self._answer(
                layer,
                sig,
                mean,
                shortlist,
                k,
                n_short,
                rerank=rerank,
                skip=skip,
                search=search,
                pooled=pooled,
                kvs=kvs,
                q_tokens=q_tokens,
                q_rows=q_rows if tokens else None,
                tokens=tokens,
            )
            for (sig, mean), shortlist, q_tokens, q_rows in zip(prepared, shortlists, span_tokens, rows)
        ]
        used = self._searched(layer, search, n_short)
        # Accesses are counted once every query is answered (a damaged entry
        # that raises leaves no count behind), in order: each query's results
        # show the counts of the queries before it, as one after another.
        counts: list[list[int] | None] = [None] * len(answers)
        if count_access and not state.read_only:
            with state.counts_lock:  # other threads' queries count too (hmem/store/rwlock.py)
                counts = [self.count_access(answer.positions).tolist() for answer in answers]
        return [answer.results(framework, used, now) for answer, now in zip(answers, counts)]

    def _token_rerank(self, asked: int | None, rerank: bool) -> int:
        """How many candidates a query re-ranks by tokens: `asked`, or the
        store's token_rerank when None; none without re-rank."""
        if asked is None:
            return self.state.config.token_rerank if rerank else 0
        n = validation.integer(asked, "token_rerank", low=0, high=MAX_TOKEN_RERANK)
        if n and not rerank:
            raise InvalidArgumentError("token_rerank re-ranks what the pooled keys ranked: it needs rerank=True")
        return n

    def _searched(self, layer: int, search: str, n: int) -> str:
        """How a search of mode `search` for n rows ran on this layer: what
        "auto" chose, for QueryResults.search."""
        if search == "spans":
            return "spans"
        index = self.state.search_index.layers.get(layer)
        return "two-stage" if index is not None and index.two_stage(search, n) else "full"

    def _read_ahead(
        self,
        shortlists: list[tuple[np.ndarray, np.ndarray]],
        means: list[np.ndarray],
        k: int,
        rerank: bool,
        check: bool | None,
        span_tokens: list[int | None],
    ) -> tuple[dict[int, np.ndarray], dict[int, tuple]]:
        """The pooled keys of every shortlisted entry of a batch (from
        pooled.bin, or else its shard) and the K/V of every entry its
        queries will return, read shard by shard: each query alone would
        map the same shards again and again (a store keeps only
        max_open_shards mapped).  A read that finds damage is left out;
        the query that needs the entry reads it again and meets the damage
        as a query of its own would."""
        records = self.state.records
        pooled: dict[int, np.ndarray] = {}
        if rerank:
            wanted = np.unique(np.concatenate([pos for pos, _ in shortlists]))
            keys, found = self._from_pooled_file(wanted, skip=check is True)
            pooled = dict(zip(wanted[found].tolist(), keys[found]))
            pooled.update(
                self._read_by_shard(
                    wanted[~found], lambda pos: self.reader.tensor(pos, "p", check=check).ravel(), ("p",)
                )
            )
        finals = []
        for (positions, _), mean, q_tokens in zip(shortlists, means, span_tokens):
            if rerank and len(positions):
                if not all(int(pos) in pooled for pos in positions):
                    continue  # damaged: this query reads on its own
                cosines = self._rerank_cosines(
                    positions, np.stack([pooled[int(pos)] for pos in positions]), mean, q_tokens
                )
                positions = positions[np.lexsort((records["entry_id"][positions], -cosines))[:k]]
            finals.append(positions)
        kvs = self._read_by_shard(
            np.concatenate(finals) if finals else np.zeros(0, dtype=np.int64),
            lambda pos: self.reader.kv(pos, check=check),
        )
        return pooled, kvs

    def _read_by_shard(
        self, positions: np.ndarray, read: Callable[[int], T], kinds: tuple[str, ...] | None = None
    ) -> dict[int, T]:
        """read(pos) of each distinct position, in shard order; damaged ones left out."""
        unique = np.unique(positions)
        out: dict[int, T] = {}
        self.reader.prefetch(unique, kinds)  # object storage: all at once
        for pos in unique[np.argsort(self.state.records["shard_idx"][unique], kind="stable")].tolist():
            try:
                out[pos] = read(pos)
            except CorruptStoreError:
                pass
        return out

    def _answer(
        self,
        layer: int,
        signature: np.ndarray,
        q_mean: np.ndarray,
        shortlist: tuple[np.ndarray, np.ndarray],
        k: int,
        n_short: int,
        *,
        rerank: bool,
        skip: bool,
        search: str,
        pooled: dict[int, np.ndarray],
        kvs: dict[int, tuple[np.ndarray, np.ndarray]],
        q_tokens: int | None,
        q_rows: np.ndarray | None,
        tokens: int,
    ) -> _Answer:
        """One query's answer from its signature shortlist (record
        positions, Hamming distances), re-ranked and read.  `pooled` and
        `kvs` hold tensors already read, by record position; `q_tokens` is
        the query's token count in a span search; with `tokens`, the best
        `tokens` candidates by pooled keys are ranked again by max-sim of
        the query's rows `q_rows` over each one's stored keys."""
        state = self.state
        # "skip" checks every tensor it hands out, verify_reads or not: a
        # skipped entry is one whose damage was seen, so one never seen must
        # have been checked (docs/reliability.md, "Degraded reads").
        skipped: dict[int, SkippedEntry] | None = {} if skip else None
        check = True if skip else None
        positions, dists = shortlist
        sims = np.asarray(similarity(dists, self._bits(search)))
        ids = state.records["entry_id"]
        while True:  # each pass that finds damage leaves more out, so this ends
            cosines: np.ndarray | None = None
            token_scores: np.ndarray | None = None
            if rerank and len(positions):
                keys = self._pooled_keys(positions, pooled, check, skipped)
                if keys is None:
                    positions, sims = self._shortlist(layer, signature, n_short, search, skipped, rerank)
                    continue
                cosines = self._rerank_cosines(positions, keys, q_mean, q_tokens)
                order = np.lexsort((ids[positions], -cosines))[: max(k, tokens)]
                positions, sims, cosines = positions[order], sims[order], cosines[order]
            if tokens and len(positions):
                assert q_rows is not None
                int8 = state.config.storage_dtype == "int8"
                self.reader.prefetch(positions, ("k", "ks") if int8 else ("k",))  # object storage: all at once
                rows = self._read_all(positions, lambda pos: self.reader.keys(pos, check=check), skipped)
                if rows is None:
                    positions, sims = self._shortlist(layer, signature, n_short, search, skipped, rerank)
                    continue
                token_scores = max_sim(q_rows, rows)
                order = np.lexsort((ids[positions], -token_scores))[:k]
                positions, sims, token_scores = positions[order], sims[order], token_scores[order]
                cosines = None if cosines is None else cosines[order]
            self.reader.prefetch(positions[~np.isin(positions, list(kvs))])  # object storage: all at once
            kv = self._read_all(
                positions, lambda pos: kvs[pos] if pos in kvs else self.reader.kv(pos, check=check), skipped
            )
            if kv is not None:
                break
            positions, sims = self._shortlist(layer, signature, n_short, search, skipped, rerank)
        return _Answer(
            positions,
            self.state.records[list(_RESULT_FIELDS)][positions].tolist(),
            sims.tolist(),
            None if cosines is None else cosines.tolist(),
            None if token_scores is None else token_scores.tolist(),
            kv,
            () if skipped is None else tuple(skipped.values()),
        )

    def _from_pooled_file(self, positions: np.ndarray, *, skip: bool) -> tuple[np.ndarray, np.ndarray]:
        """(keys, found): the pooled keys pooled.bin holds for these
        positions.  None are taken when skipping damaged entries: a skipping
        re-rank reads each candidate's key from its shard, so that a
        candidate it cannot read leaves the shortlist and the next best
        takes its place (docs/reliability.md, "Degraded reads")."""
        state = self.state
        committed = positions < state.committed_n
        if not skip and len(positions) and committed.all():  # the usual case, without index arrays
            return state.pooled.get(positions, state.records["entry_id"][positions])
        keys = np.zeros((len(positions), state.config.pooled_width), dtype=np.float32)
        found = np.zeros(len(positions), dtype=bool)
        if committed.any() and not skip:
            where = np.flatnonzero(committed)
            keys[where], found[where] = state.pooled.get(positions[where], state.records["entry_id"][positions[where]])
        return keys, found

    def _pooled_keys(
        self,
        positions: np.ndarray,
        pooled: dict[int, np.ndarray],
        check: bool | None,
        skipped: dict[int, SkippedEntry] | None,
    ) -> np.ndarray | None:
        """The pooled key of each position: from pooled.bin where its row is
        usable, else from `pooled` (read ahead) or the entry's shard, as
        _read_all reads (None when `skipped` gained entries)."""
        keys, found = self._from_pooled_file(positions, skip=skipped is not None)
        if found.all():
            return keys
        missing = np.flatnonzero(~found)
        rest = self._read_all(
            positions[missing],
            lambda pos: pooled[pos] if pos in pooled else self.reader.tensor(pos, "p", check=check).ravel(),
            skipped,
        )
        if rest is None:
            return None
        keys[missing] = np.stack(rest)
        return keys

    def _shortlist(
        self,
        layer: int,
        signature: np.ndarray,
        n: int,
        search: str,
        skipped: dict[int, SkippedEntry] | None,
        rerank: bool,
        raw: bool = False,
    ) -> tuple[np.ndarray, np.ndarray]:
        """(record positions, similarities) of the `n` entries of the layer
        nearest by signature, the skipped ones left out (so the next take
        their places: the order is the same total order either way).  A
        span search to re-rank takes SPAN_SHORTLIST x n by span and n by
        whole signature.  `raw`: Hamming distances, not similarities."""
        state = self.state
        wanted = n + (len(skipped) if skipped else 0)
        if search == "spans" and rerank:
            positions, dists = state.search_index.search_spans(layer, signature, SPAN_SHORTLIST * wanted, whole=wanted)
        elif search == "spans":
            positions, dists = state.search_index.search_spans(layer, signature, wanted)
        else:
            positions, dists = state.search_index.search(layer, signature, wanted, search)
        if skipped:
            keep = ~np.isin(positions, np.fromiter(skipped, dtype=np.int64, count=len(skipped)))
            positions, dists = positions[keep], dists[keep]
            if search != "spans":
                positions, dists = positions[:n], dists[:n]
        return positions, dists if raw else np.asarray(similarity(dists, self._bits(search)))

    def _bits(self, search: str) -> int:
        """Bits of the signatures a search of this mode compares."""
        config = self.state.config
        return config.span_signature_bytes * 8 if search == "spans" else config.hdc_dim

    def _rerank_cosines(
        self, positions: np.ndarray, keys: np.ndarray, q_mean: np.ndarray, q_tokens: int | None
    ) -> np.ndarray:
        """The re-rank score of each candidate from its pooled keys (float32
        [m, signatures_per_entry x embed_dim]): the cosine of its mean key;
        for a span search of q_tokens tokens, the best cosine of its mean
        key and the keys of its spans of at least SPAN_MIN_SHARE x q_tokens
        tokens."""
        config = self.state.config
        dim = config.embed_dim
        if q_tokens is None:
            return _cosines(keys[:, :dim], q_mean)
        scores = _cosines_rows(keys.reshape(-1, dim), q_mean).reshape(len(keys), config.signatures_per_entry)
        n_tokens = self.state.records["n_tokens"][positions].astype(np.int64)
        first, end = span_bounds(np.concatenate([[0], np.cumsum(n_tokens)]), config.spans, layout=config.span_layout)
        held = (end - first) >= SPAN_MIN_SHARE * q_tokens
        scores[:, 1:] = np.where(held, scores[:, 1:], -np.inf)
        return scores.max(axis=1)

    def _read_all(
        self, positions: np.ndarray, read: Callable[[int], T], skipped: dict[int, SkippedEntry] | None
    ) -> list[T] | None:
        """read(pos) of every position.  Raising on damage (`skipped` None),
        or noting each damaged entry in `skipped` and returning None when it
        found any (the caller ranks again without them)."""
        if skipped is None:
            return [read(int(pos)) for pos in positions]
        out: list[T] = []
        for pos in positions.tolist():
            try:
                out.append(read(pos))
            except CorruptStoreError as exc:
                skipped[pos] = self._skipped(pos, exc)
        return None if len(out) < len(positions) else out

    def _skipped(self, pos: int, exc: CorruptStoreError) -> SkippedEntry:
        row = self.state.records[pos]
        entry_id, shard_idx = int(row["entry_id"]), int(row["shard_idx"])
        shards = self.state.shards
        shard = shards[shard_idx].file if shard_idx < len(shards) else store_files.shard_file(shard_idx)
        reason = exc.message.removeprefix(f"entry {entry_id}: ")  # the entry is named beside it
        return SkippedEntry(entry_id, shard, reason)

    def count_access(self, positions: np.ndarray) -> np.ndarray:
        """One more access of each record (persisted by the next flush);
        returns their counts now.  The caller holds state.counts_lock."""
        state = self.state
        counts = state.records["access_count"]
        now = np.minimum(counts[positions].astype(np.int64) + 1, validation.U32_MAX)
        counts[positions] = now
        # every position, committed or not: a flush under way may be
        # writing an uncommitted record with the count it had before
        state.dirty.update(int(p) for p in positions)
        return now


# the record fields a QueryResult carries, in _Answer.results' order
_RESULT_FIELDS = ("entry_id", "layer_idx", "n_tokens", "importance", "timestamp", "access_count", "shard_idx")


class _Answer(NamedTuple):
    """One query's answer before its results are made: its record
    positions and, for each, its _RESULT_FIELDS, similarity, cosine (None
    without re-rank), token score (None without a token re-rank) and K/V."""

    positions: np.ndarray
    rows: list[tuple]
    sims: list[float]
    cosines: list[float] | None
    token_scores: list[float] | None
    kvs: list[tuple[np.ndarray, np.ndarray]]
    skipped: tuple[SkippedEntry, ...]

    def results(self, framework: str, search: str, access_counts: list[int] | None) -> QueryResults:
        """The QueryResults, each access count the one given (the counts
        after this query's accesses) or else the record's."""
        out = []
        for i, (entry_id, layer_idx, n_tokens, importance, timestamp, access_count, shard_idx) in enumerate(self.rows):
            sim = self.sims[i]
            cosine = None if self.cosines is None else self.cosines[i]
            token_score = None if self.token_scores is None else self.token_scores[i]
            keys, values = self.kvs[i]
            out.append(
                QueryResult(
                    entry_id=entry_id,
                    layer_idx=layer_idx,
                    score=token_score if token_score is not None else sim if cosine is None else cosine,
                    similarity=sim,
                    cosine=cosine,
                    keys=as_framework(keys, framework),
                    values=as_framework(values, framework),
                    n_tokens=n_tokens,
                    importance=importance,
                    timestamp=timestamp,
                    access_count=access_count if access_counts is None else access_counts[i],
                    shard_idx=shard_idx,
                    token_score=token_score,
                )
            )
        return QueryResults(out, self.skipped, search)


def _cosines(pooled_rows: np.ndarray | list[np.ndarray], target: np.ndarray) -> np.ndarray:
    # Row by row with numpy's own reduction (not a BLAS product, whose
    # rounding depends on a row's place in the block): an entry's cosine
    # is the same whatever the other candidates, and equal keys tie.
    pooled = np.asarray(pooled_rows, dtype=np.float64)
    norms = np.sqrt((pooled * pooled).sum(axis=1)) * np.sqrt((target * target).sum())
    dots = (pooled * target).sum(axis=1)
    return np.divide(dots, norms, out=np.zeros_like(dots), where=norms > 0)


def _cosines_rows(pooled_rows: np.ndarray, target: np.ndarray) -> np.ndarray:
    # _cosines for the many rows of a span re-rank (S per candidate): einsum
    # sums each row in the same order wherever it stands in the block (no
    # BLAS), as _cosines does, at a quarter of its time.
    pooled = pooled_rows.astype(np.float64)
    norms = np.sqrt(np.einsum("ij,ij->i", pooled, pooled)) * np.sqrt(np.einsum("i,i->", target, target))
    dots = np.einsum("ij,j->i", pooled, target)
    return np.divide(dots, norms, out=np.zeros_like(dots), where=norms > 0)
