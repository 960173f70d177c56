"""``load_shared`` / ``newest_ref``: another process of the node maps the very snapshot a load returned, or
learns it cannot.

A restarted DDP group's ranks on rank 0's node read rank 0's restored snapshot from shared memory instead of
receiving it by broadcast (``StreamSession``); they must get exactly those bytes or a clear "no", never another
snapshot's: a buffer since overwritten, a buffer of the same name holding another snapshot (another node, or a
later save), a snapshot overwritten while it was being read.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from typing import Any

import numpy as np

from streamrover.ckpt import Checkpointer, LoadedFrom, load_shared, namespace_for, newest_ref


def _state(seed: int) -> dict[str, Any]:
    return {"w": np.random.default_rng(seed).standard_normal(50_000).astype(np.float32), "n": seed}


def test_a_process_maps_the_loaded_snapshot_and_refuses_any_other(root: str) -> None:
    ckpt = Checkpointer(root, saver="thread")
    try:
        ckpt.save(1, _state(1), persist=False)
        loaded = ckpt.load(restore=False)
        assert loaded.source is LoadedFrom.MEMORY and loaded.snapshot is not None
        ref = loaded.snapshot
        assert newest_ref(namespace_for(root), 0) == ref, "found by its namespace and rank as well"
        assert newest_ref(namespace_for(root), 1) is None and newest_ref(namespace_for(root + "x"), 0) is None
        # another process of this node: it gets the snapshot's bytes (the state crosses as a checksum)
        code = (
            "import sys, json, numpy as np; from streamrover.ckpt import SnapshotRef, load_shared; "
            "got = []; ok = load_shared(SnapshotRef(**json.loads(sys.argv[1])), lambda s: got.append("
            "(float(np.asarray(s['w'], dtype=np.float64).sum()), s['n']))); print(ok, *got[0])"
        )
        out = subprocess.run([sys.executable, "-c", code, json.dumps(dataclasses.asdict(ref))], check=True,
                             capture_output=True, text=True).stdout.split()  # fmt: skip
        assert out == ["True", repr(float(_state(1)["w"].astype(np.float64).sum())), "1"], out

        calls: list[Any] = []
        assert not load_shared(dataclasses.replace(ref, uid="0" * 16), calls.append), "another snapshot's id"
        assert not load_shared(dataclasses.replace(ref, name=ref.name + "x"), calls.append), "no such buffer"
        assert not calls, "nothing is handed over from a snapshot that is not the one named"

        # read while the buffer is overwritten (two saves: the ring of two buffers comes back to it): torn, refused
        def overwrite(state: Any) -> None:
            ckpt.save(2, _state(2), persist=False)
            ckpt.save(3, _state(3), persist=False)

        assert not load_shared(ref, overwrite)
        assert not load_shared(ref, calls.append) and not calls, "its generation moved on: the snapshot is gone"
        newest = ckpt.load(restore=False)
        assert newest.step == 3 and newest.snapshot is not None and newest.snapshot.name == ref.name
        assert newest_ref(namespace_for(root), 0) == newest.snapshot
        got: list[Any] = []
        assert load_shared(newest.snapshot, lambda s: got.append(np.array(s["w"])))
        np.testing.assert_array_equal(got[0], _state(3)["w"])
    finally:
        ckpt.close(unlink=True)


def test_a_snapshot_from_storage_has_no_shared_ref(root: str) -> None:
    ckpt = Checkpointer(root, saver="thread")
    try:
        ckpt.save(1, _state(1))
        ckpt.wait(timeout=60)
        loaded = ckpt.load(restore=False, memory=False)
        assert loaded.source is LoadedFrom.STORAGE and loaded.snapshot is None
    finally:
        ckpt.close(unlink=True)
