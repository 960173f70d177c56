"""``streamrover checkpoints list|show URL``: the checkpoints on storage and their lineage.

::

    streamrover checkpoints list URL [--json]              every checkpoint: step, state, cut, what it learned
    streamrover checkpoints show URL [--step N] [--json]   one checkpoint (default: the newest complete one):
                                                           its offset ranges per partition, and what is new
                                                           since the complete checkpoint before it
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from rich.console import Console
from rich.table import Table

from streamrover.ckpt.api import CheckpointError
from streamrover.ckpt.lineage import CheckpointInfo, list_checkpoints, new_since
from streamrover.cursor import DataCursor


def add_parsers(sub: Any) -> None:
    """Add ``checkpoints list`` and ``checkpoints show`` to the ``streamrover`` command's subparsers."""
    ck = sub.add_parser("checkpoints", help="checkpoints on storage and their lineage (offset ranges learned from)")
    csub = ck.add_subparsers(dest="checkpoints_command", required=True)
    lst = csub.add_parser("list", help="every checkpoint under URL")
    lst.add_argument("url", help="the checkpoint root (a path or an fsspec URL: the trainer's --ckpt-dir)")
    lst.add_argument("--json", action="store_true")
    show = csub.add_parser("show", help="one checkpoint's lineage: offset ranges per partition")
    show.add_argument("url", help="the checkpoint root (a path or an fsspec URL)")
    show.add_argument("--step", type=int, default=None, help="the checkpoint's step (default: the newest complete)")
    show.add_argument("--json", action="store_true")


def handles(args: argparse.Namespace) -> bool:
    """Whether ``args`` is a ``checkpoints`` command (this module runs it)."""
    return bool(args.command == "checkpoints")


def _ranges(ranges: list[list[int]]) -> str:
    return ", ".join(f"[{a}, {b})" for a, b in ranges) or "-"


def _with_previous(infos: list[CheckpointInfo]) -> list[tuple[CheckpointInfo, CheckpointInfo | None]]:
    """Each checkpoint with the complete one before it (what it learned since is the difference)."""
    out: list[tuple[CheckpointInfo, CheckpointInfo | None]] = []
    previous: CheckpointInfo | None = None
    for info in infos:
        out.append((info, previous))
        if info.complete:
            previous = info
    return out


def _state(info: CheckpointInfo) -> str:
    return "complete" if info.complete else ("corrupt" if info.error.startswith("corrupt") else "partial")


def _document(info: CheckpointInfo, previous: CheckpointInfo | None) -> dict[str, Any]:
    doc: dict[str, Any] = {"step": info.step, "state": _state(info)}
    if not info.complete:
        return {**doc, "error": info.error}
    new = new_since(info.cursor, previous.cursor if previous else DataCursor())
    return {**doc, "cut_ids": info.cut_ids, "world_size": info.world_size, "lineage": info.lineage,
            "previous_step": previous.step if previous else None, "new_positions": new.size(),
            "new_since_previous": [{"dataset": k.dataset, "epoch": k.epoch, "partition": k.partition,
                                    "ranges": iv.to_list()} for k, iv in new.items()]}  # fmt: skip


def main(args: argparse.Namespace, console: Console) -> int:
    """Run ``checkpoints list`` or ``checkpoints show``; 2 when there is nothing to show."""
    try:
        infos = list_checkpoints(args.url)
    except CheckpointError as exc:
        console.print(f"[red]error:[/red] {exc}")
        return 2
    pairs = _with_previous(infos)
    if args.checkpoints_command == "list":
        if args.json:
            print(json.dumps([_document(i, p) for i, p in pairs], indent=2))
            return 0
        table = Table(title=f"checkpoints in {args.url}")
        for col in ("step", "state", "cut", "ranks", "partitions", "positions learned", "new since previous", "lost"):
            table.add_column(col, justify="left" if col == "state" else "right")
        for info, prev in pairs:
            if not info.complete:
                table.add_row(str(info.step), f"{_state(info)}: {info.error}", "", "", "", "", "", "")
                continue
            doc = _document(info, prev)
            lost = sum(e["positions"] for e in info.lineage.get("lost", []))
            since = f"{doc['new_positions']:,}" + (f" (since {prev.step})" if prev else "")
            table.add_row(str(info.step), "complete", ",".join(map(str, info.cut_ids)), str(info.world_size),
                          str(len(info.lineage.get("learned", []))), f"{info.lineage.get('positions', 0):,}", since,
                          f"{lost:,}")  # fmt: skip
        console.print(table if infos else f"no checkpoints in {args.url}")
        return 0
    return _show(args, console, pairs)


def _show(args: argparse.Namespace, console: Console, pairs: list[tuple[CheckpointInfo, CheckpointInfo | None]]) -> int:
    complete = [(i, p) for i, p in pairs if i.complete]
    if args.step is None:
        if not complete:
            console.print(f"[red]error:[/red] no complete checkpoint in {args.url}")
            return 2
        info, prev = complete[-1]
    else:
        found = [(i, p) for i, p in pairs if i.step == args.step]
        if not found:
            steps = ", ".join(str(i.step) for i, _ in pairs) or "none"
            console.print(f"[red]error:[/red] no checkpoint of step {args.step} in {args.url} (steps: {steps})")
            return 2
        info, prev = found[0]
    doc = _document(info, prev)
    if args.json:
        print(json.dumps(doc, indent=2))
        return 0
    if not info.complete:
        console.print(f"checkpoint step {info.step} in {args.url}: {doc['error']}")
        return 2
    console.print(f"checkpoint step {info.step} in {args.url}: cut {','.join(map(str, info.cut_ids)) or '-'}, "
                  f"{info.world_size} rank(s), {info.lineage.get('positions', 0):,} positions learned"
                  + (f", {doc['new_positions']:,} new since step {prev.step}" if prev else ""))  # fmt: skip
    new = {(e["dataset"], e["epoch"], e["partition"]): e["ranges"] for e in doc["new_since_previous"]}
    table = Table(title="learned from (offset ranges per partition, [start, end))")
    for col in ("dataset", "epoch", "partition", "ranges", "positions", "new since previous"):
        table.add_column(col, justify="right" if col in ("epoch", "positions") else "left")
    for e in info.lineage.get("learned", []):
        table.add_row(e["dataset"], str(e["epoch"]), e["partition"], _ranges(e["ranges"]), f"{e['positions']:,}",
                      _ranges(new.get((e["dataset"], e["epoch"], e["partition"]), [])))  # fmt: skip
    console.print(table)
    if info.lineage.get("lost"):
        lost = Table(title="lost (deleted upstream before they were trained: never learned from)")
        for col in ("dataset", "epoch", "partition", "ranges", "positions"):
            lost.add_column(col)
        for e in info.lineage["lost"]:
            lost.add_row(e["dataset"], str(e["epoch"]), e["partition"], _ranges(e["ranges"]), f"{e['positions']:,}")
        console.print(lost)
    return 0
