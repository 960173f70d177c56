"""One SeaweedFS S3 server for the session (tests/s3/seaweed.py); each test gets a bucket of its own and the
usual AWS environment variables pointing at the server (children inherit them: masters, workers, savers)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from .seaweed import BUCKET, SeaweedS3, weed_binary


@pytest.fixture(scope="session")
def seaweed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SeaweedS3]:
    server = SeaweedS3(tmp_path_factory.mktemp("seaweedfs"), weed_binary())
    server.start()
    yield server
    server.kill()  # its data is the session's temporary directory: no need for a graceful stop (~13 s)


@dataclass
class Bucket:
    """A test's own prefix in the session's bucket."""

    server: SeaweedS3
    name: str  # the bucket
    prefix: str
    fs: Any  # an s3fs.S3FileSystem signed with the test identity

    def key(self, *parts: str) -> str:
        return "/".join([self.prefix, *parts])

    def path(self, *parts: str) -> str:
        return f"{self.name}/{self.key(*parts)}"

    def url(self, *parts: str) -> str:
        return f"s3://{self.path(*parts)}"


@pytest.fixture
def bucket(seaweed: SeaweedS3, monkeypatch: pytest.MonkeyPatch) -> Bucket:
    """A new, empty prefix; the AWS variables set for this test (and the processes it starts)."""
    if not seaweed.proc.running():  # a test that restarts the server must leave it running; else start it again
        seaweed.start()
    for key, value in seaweed.env().items():
        monkeypatch.setenv(key, value)
    return Bucket(seaweed, BUCKET, f"t-{uuid.uuid4().hex[:12]}", seaweed.filesystem())
