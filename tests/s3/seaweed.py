"""A real S3-compatible object store for the tests: SeaweedFS (``weed server``: master, volume, filer, S3 gateway).

The ``weed`` binary is built from Go modules by ``scripts/build-seaweedfs.sh`` (``make test``'s set-up starts
that build in the background; :func:`weed_binary` waits for it, or builds it if nothing did, and fails naming
the build log if the build failed). Requests are signed (SigV4) with the one identity of an S3 config file;
everything binds 127.0.0.1 on free ports, telemetry is off. Data lives under ``root``, so a restart (same
ports, same directory) keeps every object.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

from tests.brokers._process import ChildProcess, MissingDependencyError, free_ports, repo_root, wait_until

ACCESS_KEY = "streamrover-test"
SECRET_KEY = "streamrover-test-secret-0123456789"
REGION = "us-east-1"
#: The tests' one bucket, made at the first start (SeaweedFS grows a new volume for each bucket's first write:
#: seconds; tests take a prefix each instead).
BUCKET = "streamrover-tests"
BUILD_TIMEOUT = 3600.0  # a cold build on a loaded 2-core machine


def weed_binary(timeout: float = BUILD_TIMEOUT) -> Path:
    """The built ``weed`` binary, waiting for (or running) ``scripts/build-seaweedfs.sh``."""
    script = repo_root() / "scripts" / "build-seaweedfs.sh"
    bin_dir = Path(subprocess.run(["bash", str(script), "--bin-dir"], capture_output=True, text=True,
                                  check=True).stdout.strip())  # fmt: skip
    if not (bin_dir / ".complete").exists():
        proc = subprocess.run(["bash", str(script), "--wait"], capture_output=True, text=True, timeout=timeout,
                              check=False)  # fmt: skip
        if proc.returncode != 0 or not (bin_dir / ".complete").exists():
            raise MissingDependencyError(
                f"the SeaweedFS binary is not in {bin_dir}: `scripts/build-seaweedfs.sh --wait` exited "
                f"{proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
            )
    return bin_dir / "weed"


class SeaweedS3:
    """One ``weed server -filer -s3`` under ``root``; ``endpoint`` is the S3 gateway's URL."""

    def __init__(self, root: Path, weed: Path) -> None:
        self.root = root
        master, master_grpc, volume, volume_grpc, filer, filer_grpc, s3, s3_grpc = free_ports(8)
        self.port = s3
        self._grpc_ports = {"master": master_grpc, "volume": volume_grpc, "filer": filer_grpc, "s3": s3_grpc}
        self.endpoint = f"http://127.0.0.1:{s3}"
        (root / "data").mkdir(parents=True, exist_ok=True)
        config = root / "s3.json"
        config.write_text(json.dumps({"identities": [{
            "name": "streamrover", "credentials": [{"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}],
            "actions": ["Admin", "Read", "List", "Tagging", "Write"],
        }]}))  # fmt: skip
        self.proc = ChildProcess("seaweedfs", [
            str(weed), "server", "-ip=127.0.0.1", "-ip.bind=127.0.0.1", f"-dir={root / 'data'}",
            "-master.telemetry=false", "-master.volumeSizeLimitMB=64", "-volume.max=0", "-master.electionTimeout=1s",
            f"-master.port={master}", f"-master.port.grpc={master_grpc}",
            f"-volume.port={volume}", f"-volume.port.grpc={volume_grpc}",
            "-filer", f"-filer.port={filer}", f"-filer.port.grpc={filer_grpc}",
            f"-filer.localSocket={root / 'filer.sock'}",
            "-s3", f"-s3.port={s3}", f"-s3.port.grpc={s3_grpc}", "-s3.port.iceberg=0", "-s3.port.lance=0",
            f"-s3.config={config}", f"-s3.localSocket={root / 's3.sock'}",
        ], root / "seaweedfs.log")  # fmt: skip

    def env(self) -> dict[str, str]:
        """The usual AWS variables that point botocore (s3fs, pyarrow) at this server."""
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": ACCESS_KEY,
            "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
            "AWS_DEFAULT_REGION": REGION,
        }

    def storage_options(self) -> dict[str, Any]:
        """The same settings as fsspec storage options (``s3fs.S3FileSystem`` keyword arguments)."""
        return {"key": ACCESS_KEY, "secret": SECRET_KEY, "endpoint_url": self.endpoint,
                "client_kwargs": {"region_name": REGION}}  # fmt: skip

    def filesystem(self) -> Any:
        import s3fs

        return s3fs.S3FileSystem(skip_instance_cache=True, **self.storage_options())

    def start(self, timeout: float = 120.0) -> None:
        """Start, and wait until an object can be written: the gateway answers only once the filer is up, and a
        write needs a volume server registered with the master too (after a restart that comes seconds later)."""
        import s3fs

        self.proc.start()
        fs = s3fs.S3FileSystem(skip_instance_cache=True, **self.storage_options(), config_kwargs={
            "connect_timeout": 2, "read_timeout": 5, "retries": {"max_attempts": 1}})  # fmt: skip

        def writable() -> bool:
            fs.invalidate_cache()
            if BUCKET not in fs.ls(""):
                fs.mkdir(BUCKET)
            fs.pipe(f"{BUCKET}/probe", b"1")
            return True

        wait_until("the SeaweedFS S3 gateway taking a signed PUT", writable, timeout=timeout, procs=[self.proc])

    def stop(self) -> None:
        self.proc.stop(timeout=15)
        self._remove_sockets()

    def kill(self) -> None:
        self.proc.kill()
        self._remove_sockets()

    def _remove_sockets(self) -> None:
        """weed binds a unix socket beside each gRPC port at a fixed /tmp path (not $TMPDIR) and leaves it behind."""
        for name, port in self._grpc_ports.items():
            Path(f"/tmp/seaweedfs-{name}-grpc-{port}.sock").unlink(missing_ok=True)

    def check_alive(self) -> None:
        if not self.proc.running():
            raise AssertionError(f"seaweedfs exited ({self.proc.returncode()}):\n{self.proc.log_tail()}")
