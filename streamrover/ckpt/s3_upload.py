"""Multipart uploads to S3 straight from a checkpoint's pieces, several parts in flight.

s3fs's file object uploads one part at a time (each write that fills its block is sent before the next write
returns); against a real S3 that caps a persist at one connection's speed. Here the pieces (views of shared
memory) are cut into parts of ``part_size`` bytes, each part a file-like view of its pieces (no copy of a part is
held: the HTTP client reads it in small blocks), and up to ``concurrency`` parts are uploaded at once. The object
appears when the
upload completes, whole; on any failure the upload is aborted, so nothing appears at the key. A process killed
mid-upload leaves the parts on the server, invisible, for a bucket lifecycle rule to remove.
"""

from __future__ import annotations

import asyncio
import io
import logging
from collections.abc import Iterable
from typing import Any, Protocol

log = logging.getLogger(__name__)

PART_SIZE = 64 << 20  # S3: 5 MiB to 5 GiB per part, at most 10,000 parts (640 GiB at this size)
CONCURRENCY = 10  # s3fs's max_concurrency default


class PartBody(io.RawIOBase):
    """A read-only, seekable file over the concatenation of ``views`` (botocore rewinds it to checksum or retry)."""

    def __init__(self, views: list[memoryview]) -> None:
        super().__init__()
        self._views = views
        self._starts: list[int] = []
        total = 0
        for v in views:
            self._starts.append(total)
            total += len(v)
        self.size = total
        self._pos = 0

    def __len__(self) -> int:
        return self.size

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self.size}[whence]
        self._pos = min(max(base + offset, 0), self.size)
        return self._pos

    def read(self, size: int | None = -1) -> bytes:
        want = self.size - self._pos if size is None or size < 0 else min(size, self.size - self._pos)
        out = bytearray(want)
        n = self.readinto(out)
        return bytes(out[:n]) if n < want else bytes(out)

    def readinto(self, buffer: Any) -> int:
        target = memoryview(buffer).cast("B")
        done = 0
        i = max(0, _bisect(self._starts, self._pos))
        while done < len(target) and i < len(self._views) and self._pos < self.size:
            view, start = self._views[i], self._starts[i]
            piece = view[self._pos - start : self._pos - start + len(target) - done]
            target[done : done + len(piece)] = piece
            done += len(piece)
            self._pos += len(piece)
            i += 1
        return done


def _bisect(starts: list[int], pos: int) -> int:
    """The index of the view holding byte ``pos``."""
    import bisect

    return bisect.bisect_right(starts, pos) - 1


class _Hasher(Protocol):
    def update(self, chunk: Any) -> None: ...


def _parts(chunks: Iterable[memoryview], part_size: int, hasher: _Hasher) -> Iterable[PartBody]:
    """The concatenation of ``chunks`` cut into ``part_size`` bytes (the last one shorter), hashing as it goes."""
    pending: list[memoryview] = []
    size = 0
    sent = False
    for chunk in chunks:
        hasher.update(chunk)
        while chunk:
            take = chunk[: part_size - size]
            pending.append(take)
            size += len(take)
            chunk = chunk[len(take) :]
            if size == part_size:
                yield PartBody(pending)
                pending, size, sent = [], 0, True
    if pending or not sent:  # the rest; or one empty part: an empty object
        yield PartBody(pending)


def upload(fs: Any, path: str, chunks: Iterable[memoryview], hasher: _Hasher, *, part_size: int = PART_SIZE,
           concurrency: int = CONCURRENCY) -> int:  # fmt: skip
    """Upload the concatenation of ``chunks`` to ``path`` with ``fs`` (an ``s3fs.S3FileSystem``); the bytes sent."""
    from fsspec.asyn import sync

    if part_size < 5 << 20:
        raise ValueError(f"an S3 part must be at least 5 MiB, not {part_size} bytes")
    bucket, key, _ = fs.split_path(path)
    written: int = sync(fs.loop, _upload, fs, bucket, key, _parts(chunks, part_size, hasher), concurrency)
    fs.invalidate_cache(path)
    return written


async def _upload(fs: Any, bucket: str, key: str, parts: Iterable[PartBody], concurrency: int) -> int:
    it = iter(parts)
    first = next(it)
    second = next(it, None)
    if second is None:  # one part: a single PUT
        await fs._call_s3("put_object", Bucket=bucket, Key=key, Body=first)
        return first.size
    mpu = await fs._call_s3("create_multipart_upload", Bucket=bucket, Key=key)
    upload_id = mpu["UploadId"]
    slots = asyncio.Semaphore(concurrency)
    etags: dict[int, str] = {}
    tasks: list[asyncio.Task[None]] = []

    async def send(number: int, body: PartBody) -> None:
        try:
            out = await fs._call_s3("upload_part", Bucket=bucket, Key=key, UploadId=upload_id, PartNumber=number,
                                    Body=body)  # fmt: skip
            etags[number] = out["ETag"]
        finally:
            slots.release()

    written = 0
    try:
        number = 0
        for body in _chain(first, second, it):
            await slots.acquire()  # at most `concurrency` parts in memory and in flight
            for t in tasks:
                if t.done() and t.exception() is not None:
                    raise t.exception()  # type: ignore[misc]
            number += 1
            written += body.size
            tasks.append(asyncio.ensure_future(send(number, body)))
            del body
        await asyncio.gather(*tasks)
        done = {"Parts": [{"PartNumber": n, "ETag": etags[n]} for n in sorted(etags)]}
        await fs._call_s3("complete_multipart_upload", Bucket=bucket, Key=key, UploadId=upload_id, MultipartUpload=done)
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        try:
            await fs._call_s3("abort_multipart_upload", Bucket=bucket, Key=key, UploadId=upload_id)
        except Exception as exc:  # the store may be what failed: the upload stays invisible regardless
            log.warning("checkpoint storage: could not abort the upload of s3://%s/%s: %s", bucket, key, exc)
        raise
    return written


def _chain(first: PartBody, second: PartBody, rest: Iterable[PartBody]) -> Iterable[PartBody]:
    yield first
    yield second
    yield from rest
