"""Checkpoints on a real S3 server (SeaweedFS): a saver SIGKILLed in the middle of a multipart upload, and the
server killed and restarted during a persist. No manifest may point at a partial object, and the next save
succeeds."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from streamrover.ckpt import Checkpointer, namespace_for, purge_shared_memory
from streamrover.ckpt.layout import MANIFEST, complete_steps, part_names, read_manifest, read_part, step_dir
from streamrover.ckpt.storage import Storage
from tests.helpers import wait_until

from .ckpt_proc import state_at
from .conftest import Bucket

PROC = str(Path(__file__).with_name("ckpt_proc.py"))
BLOCK = 5 << 20  # S3's smallest part: a 12 MiB state is uploaded in several parts
pytestmark = pytest.mark.timeout(300)


@pytest.fixture
def root(bucket: Bucket) -> Iterator[str]:
    url = bucket.url("ckpt")
    yield url
    purge_shared_memory(namespace_for(url))


def _run(root: str, bucket: Bucket, *args: str, stdin: int | None = None) -> subprocess.Popen[str]:
    options = json.dumps({"default_block_size": BLOCK})
    return subprocess.Popen(
        [sys.executable, PROC, "--url", root, "--options", options, "--mib", "12", *args],
        stdin=stdin, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip


def _stopped(pid: int) -> bool:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "T"


def _load_from_storage(root: str) -> tuple[int, set[float]]:
    """The newest checkpoint on storage (not shared memory), read and checksum-verified by the loader."""
    ckpt = Checkpointer(root, saver="thread")
    try:
        loaded = ckpt.load(memory=False)
        return loaded.step, {float(np.unique(v)[0]) for k, v in loaded.state.items() if k.startswith("w")}
    finally:
        ckpt.close(unlink=True)


def _uploads_in_progress(bucket: Bucket) -> list[str]:
    return [u["Key"] for u in bucket.fs.list_multipart_uploads(bucket.name)]


def test_a_saver_sigkilled_mid_multipart_upload_leaves_no_partial_checkpoint(root: str, bucket: Bucket) -> None:
    proc = _run(root, bucket, "--steps", "1,2", "--stop-after-parts", "1")
    wait_until(lambda: proc.poll() is not None or _stopped(proc.pid), 120, "the saver to stop mid-upload")
    assert proc.poll() is None, proc.communicate()
    # the server holds step 2's upload in progress, with a part: the kill lands in the middle of a multipart upload
    tensors = bucket.key("ckpt", step_dir(2), part_names(0)[0])
    assert tensors in _uploads_in_progress(bucket)
    proc.kill()
    out, err = proc.communicate()
    assert out.splitlines() == ["persisted 1"], err

    storage = Storage(root)
    assert complete_steps(storage) == [1]
    assert not storage.exists(storage.join(step_dir(2), part_names(0)[0]))  # no partial object under its name
    assert not storage.exists(storage.join(step_dir(2), MANIFEST))
    assert _load_from_storage(root) == (1, {1.0})

    ckpt = Checkpointer(root, saver="thread", storage_options={"default_block_size": BLOCK})  # the next saver
    try:
        for step in (2, 3):
            ckpt.save(step, state_at(step, 12))
            ckpt.wait(timeout=120)
    finally:
        ckpt.close(unlink=True)
    assert _load_from_storage(root) == (3, {3.0})


def test_the_server_restarted_during_a_persist_fails_it_loudly_or_completes_it_and_the_next_succeeds(
    root: str, bucket: Bucket
) -> None:
    proc = _run(root, bucket, "--steps", "1,2", "--hold-after-parts", "1", stdin=subprocess.PIPE)
    assert proc.stdout is not None and proc.stdin is not None
    line = proc.stdout.readline()
    assert line.startswith("held "), proc.communicate()
    bucket.server.kill()  # SIGKILL: a crash, mid-upload
    bucket.server.start()  # same ports, same data directory
    proc.stdin.write("go\n")
    proc.stdin.flush()
    out, err = proc.communicate(timeout=180)
    lines = out.splitlines()
    assert len(lines) == 2 and lines[1] == "persisted 2", err
    storage = Storage(root)
    if lines[0] == "persisted 1":  # the upload survived the restart: the checkpoint must be whole
        assert complete_steps(storage) == [1, 2]
        _, state, _ = read_part(storage, read_manifest(storage, 1), 0)  # sizes and checksums verified
        assert {float(np.unique(v)[0]) for k, v in state.items() if k.startswith("w")} == {1.0}
    else:  # failed loudly: nothing published for it
        assert lines[0].startswith("failed 1:"), lines
        assert complete_steps(storage) == [2]
        assert not storage.exists(storage.join(step_dir(1), MANIFEST))
    print(lines[0][:300])
    assert _load_from_storage(root) == (2, {2.0})
