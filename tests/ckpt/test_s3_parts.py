"""The S3 uploader's part cutter (ckpt/s3_upload.py): pieces of any sizes become parts of exactly part_size
bytes (the last shorter), their concatenation unchanged, every byte hashed once."""

from __future__ import annotations

import random
import zlib

from streamrover.ckpt.s3_upload import _parts


class _Crc:
    def __init__(self) -> None:
        self.value = 0

    def update(self, chunk: memoryview) -> None:
        self.value = zlib.crc32(chunk, self.value)


def test_pieces_are_cut_into_parts_of_the_part_size() -> None:
    rng = random.Random(7)
    for _ in range(50):
        sizes = [rng.choice([0, 1, 5, 16, 17, 40]) for _ in range(rng.randrange(0, 8))]
        pieces = [bytes(rng.randrange(256) for _ in range(n)) for n in sizes]
        data = b"".join(pieces)
        crc = _Crc()
        bodies = list(_parts((memoryview(p) for p in pieces), 16, crc))
        parts = [b.read() for b in bodies]
        for body, part in zip(bodies, parts):  # rewound (a checksum, a retry), read in small blocks
            body.seek(0)
            got = b"".join(iter(lambda b=body: b.read(3), b""))  # type: ignore[misc]
            assert got == part and len(body) == len(part)
            body.seek(-min(5, len(part)), 2)
            assert body.read() == part[-5:]
        assert b"".join(parts) == data
        if data:
            assert all(len(p) == 16 for p in parts[:-1]) and 0 < len(parts[-1]) <= 16
        else:
            assert parts == [b""]
        assert crc.value == zlib.crc32(data)
