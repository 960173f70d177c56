"""The tables ``streamrover status`` and ``streamrover dataset ...`` print: the master's state, drawn with rich.

Each takes the answers of the shard client (``DatasetInfo`` and ``StatusResponse`` messages of
``shard_service/v1``) and returns a :class:`rich.table.Table` for the console (``cli.py``).
"""

from __future__ import annotations

from typing import Any

from rich.table import Table


def partitions_table(info: Any) -> Table:
    """A dataset's partitions as sent (the most lagging first when limited), titled with how many of how many."""
    shown, total = len(info.partitions), info.partition_count or len(info.partitions)
    more = "" if shown >= total else f", {shown:,} of {total:,}: the most lagging (--partitions N|all)"
    parts = Table(title=f"{info.spec.name}: partitions{more}")
    for col in ("#", "id", "start", "planned end", "available", "committed", "lag"):
        parts.add_column(col)
    stream = info.kind == 2
    for p in info.partitions:
        parts.add_row(
            str(p.index), p.id, str(p.start), str(p.end),
            str(p.available_end) if stream else "", str(p.committed_end), str(p.lag) if stream else "",
        )  # fmt: skip
    return parts


def dataset_table(infos: list[Any]) -> Table:
    table = Table(title="datasets")
    for col in (
        "name",
        "kind",
        "partitions",
        "records",
        "todo",
        "leased",
        "acked",
        "committed",
        "records acked",
        "records committed",
        "lag",
        "time skew",
        "dead letters",
        "state",
    ):
        table.add_column(col, justify="right" if col not in ("name", "kind") else "left")
    for info in infos:
        kind = "batch" if info.kind == 1 else "stream"
        table.add_row(
            info.spec.name,
            kind,
            f"{info.partition_count or len(info.partitions):,}",
            f"{info.total_records:,}",
            str(info.shards.todo),
            str(info.shards.leased),
            str(info.shards.acked),
            str(info.shards.committed),
            f"{info.records_acked:,}",
            f"{info.records_committed:,}",
            f"{info.lag:,}" if kind == "stream" else "",
            f"{info.time_skew_ms / 1000:.1f} s" if kind == "stream" else "",
            f"{info.dead_letters:,}",
            _state(info),
        )
    return table


def _state(info: Any) -> str:
    if info.failed:
        return f"[red]failed: {info.error}[/red]"
    if info.error:
        return f"[yellow]{info.error}[/yellow]"
    waiting = [g for g in info.commit_gaps if not g.skipped]
    if waiting:  # a sink's commit named as the previous of a later one has not arrived (dataset describe lists them)
        return f"[yellow]running, {len(waiting)} commit(s) missing for up to {waiting[0].age_seconds:.0f} s[/yellow]"
    return "finished" if info.finished else "running"


def status_view(client, partitions: int | None = None) -> Table:  # type: ignore[no-untyped-def]
    st = client.status(partitions or 0)
    outer = Table.grid()
    outer.add_row(dataset_table(list(st.datasets)))
    for info in st.datasets if partitions is not None else ():
        outer.add_row(partitions_table(info))
    workers = Table(title="workers")
    for col in ("worker", "name", "leases", "records acked", "last seen"):
        workers.add_column(col)
    for w in st.workers:
        workers.add_row(
            w.worker_id, w.name, str(w.leases), f"{w.records_acked:,}", f"{w.last_seen_seconds_ago:.1f}s ago"
        )
    outer.add_row(workers)
    outer.add_row(
        f"{st.records_per_second:,.0f} records/s  {st.acks_per_second:,.1f} acks/s  "
        f"last committed cut {st.last_committed_cut} ({st.persisting_cuts} being persisted)  "
        f"up {st.uptime_seconds:,.0f}s"
    )
    if st.cut_commit_error:
        outer.add_row(f"[red]cut commit refused:[/red] {st.cut_commit_error}")
    if st.security_warning:
        outer.add_row(f"[red]{st.security_warning}[/red]")
    return outer


def commit_gaps_table(info: Any) -> Table:
    """A dataset's commit gaps (``dataset describe``): a sink's commit named as the previous of a later one, missing."""
    gaps = Table(title="commit gaps (a later commit names this one as its previous; see sr.commit_gap_ms)")
    for col in ("producer", "part", "missing epoch", "named by epoch", "open for", "state"):
        gaps.add_column(col)
    for g in info.commit_gaps:
        gaps.add_row(g.producer, g.part, str(g.epoch), str(g.next_epoch), f"{g.age_seconds:.0f} s",
                     "skipped" if g.skipped else "open")  # fmt: skip
    return gaps
