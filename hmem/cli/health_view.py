"""How the command line shows damage: the health line of `hmem stats` and
the entries `hmem query --skip-damaged` left out (docs/cli.md)."""

from __future__ import annotations

from typing import Annotated, Any

import typer

from hmem import CorruptStoreError, Hint, QueryResults, Store, StoreHealth
from hmem.cli.exit_codes import cli_hint
from hmem.cli.output import Output


def _plural(count: int, one: str, many: str) -> str:
    return f"{count} {one if count == 1 else many}"


def health_summary(health: StoreHealth, live: int) -> str:
    """'ok', or what is wrong and how many live entries it makes unreachable."""
    if health.ok:
        return "ok"
    parts = []
    if health.missing_shards:
        parts.append(
            f"{_plural(len(health.missing_shards), 'shard', 'shards')} missing ({', '.join(health.missing_shards)})"
        )
    if health.wrong_size_shards:
        parts.append(
            f"{_plural(len(health.wrong_size_shards), 'shard', 'shards')} of the wrong size "
            f"({', '.join(health.wrong_size_shards)})"
        )
    if health.missing_shards or health.wrong_size_shards:
        parts.append(f"{health.unreachable_entries} of {live} live entries unreachable")
    if health.entries_file_problem:
        parts.append(health.entries_file_problem)
    if health.stale_index:
        parts.append(health.stale_index)
    # a problem of no field above (a store on object storage whose objects
    # could not be listed): its own sentence, never an empty line
    return ", ".join(parts or health.problems)


def health_line(health: StoreHealth, live: int) -> str:
    """The line `hmem stats` prints: 'health: ok', or the damage and what to run."""
    advice = cli_hint(health.advice)
    return f"health: {health_summary(health, live)}" + (f"; {advice}" if advice else "")


def skipped_json(results: QueryResults) -> list[dict[str, Any]]:
    return [{"entry_id": s.entry_id, "shard": s.shard, "reason": s.reason} for s in results.skipped]


def report_skipped(out: Output, results: QueryResults, layer: int) -> str:
    """One warning line on stderr per skipped entry.  Returns what the
    summary line adds ('' when nothing was skipped); raises when the damage
    left no result at all (exit 1: there is nothing to show)."""
    for s in results.skipped:
        out.warn(f"skipped damaged entry {s.entry_id} ({s.shard}): {s.reason}")
    if not results.skipped:
        return ""
    if not results:
        raise CorruptStoreError(
            f"no readable entry in layer {layer}: "
            f"{_plural(len(results.skipped), 'damaged entry', 'damaged entries')} skipped",
            hint=Hint.VERIFY_THEN_REPAIR,
        )
    skipped = _plural(len(results.skipped), "damaged entry", "damaged entries")
    return f"; {skipped} skipped ({cli_hint(Hint.VERIFY_THEN_REPAIR)})"


SkipDamagedRecordsOption = Annotated[
    bool,
    typer.Option(
        "--skip-damaged",
        help="Read past damaged records of entries.bin (listed on stderr): their entries are left out.",
    ),
]


def report_damaged_records(out: Output, store: Store) -> list[dict[str, Any]]:
    """One warning line on stderr per damaged record of entries.bin that a
    --skip-damaged read went past (Store.damaged_records); returns them as
    the JSON "skipped" rows of ``hmem query`` (entry_id null when unknown)."""
    rows = []
    for position, entry_id in store.damaged_records:
        shown = f"entry {entry_id}" if entry_id is not None else "entry unknown"
        reason = f"record {position} of entries.bin fails its checksum"
        out.warn(f"skipped damaged record {position} of entries.bin ({shown}): it fails its checksum")
        rows.append({"entry_id": entry_id, "shard": None, "reason": reason})
    return rows


def refuse_damaged(store: Store, entry_ids: list[int]) -> None:
    """An id asked for whose record --skip-damaged read past: say that its
    record is damaged (exit 1), not that the store never held it."""
    damaged = sorted({entry_id for _, entry_id in store.damaged_records if entry_id is not None} & set(entry_ids))
    if damaged:
        raise CorruptStoreError(
            f"the record of entry {', '.join(map(str, damaged))} in entries.bin is damaged: it cannot be read",
            hint=Hint.VERIFY_THEN_REPAIR,
        )
