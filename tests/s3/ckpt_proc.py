"""A trainer with its saver in-process (``saver="thread"``), checkpointing to ``s3://`` (run as a script).

It saves and persists each step of ``--steps`` (every value of the state equals the step) and prints
``persisted STEP`` or ``failed STEP: ERROR``. With ``--stop-after-parts K`` it SIGSTOPs itself (the test then
SIGKILLs it) once K parts of the last step's tensor file are uploaded: in the middle of a multipart upload,
deterministically. With ``--hold-after-parts K`` it instead prints ``held`` there and waits for a line on stdin
(the test restarts the server meanwhile). The fsspec storage options are a JSON object in ``--options``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from typing import Any

import numpy as np
import s3fs.core

from streamrover.ckpt import Checkpointer, SaverError

TENSORS = "rank-00000.safetensors"


def state_at(step: int, mib: float) -> dict[str, Any]:
    n = max(1, int(mib * (1 << 20) / 4 / 4))
    return {f"w{i}": np.full(n, step, dtype=np.float32) for i in range(4)} | {"step": step}


def pause_uploads_after(parts: int, key_suffix: str, action: str) -> None:
    """Patch s3fs: once ``parts`` parts of an upload to a key ending ``key_suffix`` are sent, stop or hold."""
    call = s3fs.core.S3FileSystem._call_s3
    sent = [0]

    async def patched(self: Any, method: str, *args: Any, **kwargs: Any) -> Any:
        out = await call(self, method, *args, **kwargs)
        if method == "upload_part" and str(kwargs.get("Key", "")).endswith(key_suffix):
            sent[0] += 1
            if sent[0] == parts and action == "stop":
                os.kill(os.getpid(), signal.SIGSTOP)  # the test SIGKILLs us here: the upload never completes
            elif sent[0] == parts:
                print(f"held {kwargs['UploadId']}", flush=True)
                sys.stdin.readline()  # blocks s3fs's event loop: the whole upload waits
        return out

    s3fs.core.S3FileSystem._call_s3 = patched


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--url", required=True)
    p.add_argument("--steps", required=True, help="comma-separated steps to save and persist, in order")
    p.add_argument("--mib", type=float, default=1.0)
    p.add_argument("--options", default="{}")
    p.add_argument("--stop-after-parts", type=int, default=0)
    p.add_argument("--hold-after-parts", type=int, default=0)
    args = p.parse_args()
    steps = [int(s) for s in args.steps.split(",")]
    if args.stop_after_parts:
        pause_uploads_after(args.stop_after_parts, f"step-{steps[-1]:012d}/{TENSORS}", "stop")
    if args.hold_after_parts:
        pause_uploads_after(args.hold_after_parts, f"step-{steps[0]:012d}/{TENSORS}", "hold")
    ckpt = Checkpointer(args.url, saver="thread", storage_options=json.loads(args.options))
    ckpt.storage.read_backoff = 0.05
    for step in steps:
        ckpt.save(step, state_at(step, args.mib))
        try:
            ckpt.wait(timeout=120)
        except SaverError as exc:
            print(f"failed {step}: {exc}", flush=True)
        else:
            print(f"persisted {step}", flush=True)
    ckpt.close(unlink=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
