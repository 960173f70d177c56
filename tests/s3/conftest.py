"""One SeaweedFS S3 server for the session (tests/s3/seaweed.py); each test gets a bucket of its own and the
usual AWS environment variables pointing at the server (children inherit them: masters, workers, savers)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from .seaweed import SeaweedS3, weed_binary


@pytest.fixture(scope="session")
def seaweed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SeaweedS3]:
    server = SeaweedS3(tmp_path_factory.mktemp("seaweedfs"), weed_binary())
    server.start()
    yield server
    server.stop()


@dataclass
class Bucket:
    server: SeaweedS3
    name: str
    fs: Any  # an s3fs.S3FileSystem signed with the test identity

    def url(self, *parts: str) -> str:
        return "/".join([f"s3://{self.name}", *parts])


@pytest.fixture
def bucket(seaweed: SeaweedS3, monkeypatch: pytest.MonkeyPatch) -> Bucket:
    """A new, empty bucket; the AWS variables set for this test (and the processes it starts)."""
    if not seaweed.proc.running():  # a test that restarts the server must leave it running; else start it again
        seaweed.start()
    for key, value in seaweed.env().items():
        monkeypatch.setenv(key, value)
    fs = seaweed.filesystem()
    name = f"t-{uuid.uuid4().hex[:12]}"
    fs.mkdir(name)
    return Bucket(seaweed, name, fs)
