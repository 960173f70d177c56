"""A KServe model server over a streamrover model repository: polls for versions, applies table deltas, predicts.

Run in the serving venv (``scripts/build-serving-venv.sh``: kserve 0.21 needs protobuf>=6, the project venv
pins <6)::

    <serving-venv>/bin/python -m streamrover.serving.server --repository /srv/models --name ctr --http-port 8080

It serves KServe's V1 protocol on CPU with onnxruntime: ``POST /v1/models/NAME:predict`` with
``{"instances": [{"ids": [...]}, ...]}`` (one object per row, keyed by the graph's input names) answers
``{"predictions": [...], "model_version": "N"}``; ``GET /v1/models/NAME`` says whether a version is loaded.

How versions are loaded (every ``--poll`` seconds, in a background thread): the newest published version N
is read; its chain (base, then deltas: each names its parent) is followed back from N. If the version being
served is on that chain, only the deltas after it are applied, in order, to a copy of the served tables
(``table[rows] = values``); otherwise (a first load, a new base, or a retired timeline) the tables are rebuilt
from N's base. Then the ONNX session of N is built and swapped in with the tables under one lock, so a
request sees one version whole. Embedding tables are graph inputs; the server feeds them to each run.
Importing this module needs numpy and onnxruntime; kserve only when the server starts.
"""

from __future__ import annotations

import argparse
import json
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from streamrover.serving.api import DELTA_FILE, MODEL_FILE, BrokenChainError, ServingError
from streamrover.serving.repository import ModelRepository
from streamrover.serving.tables import apply_delta, load_arrays, read_tables

log = logging.getLogger(__name__)


@dataclass
class Loaded:
    """One loaded version: its session, tables, input and output names, and when it was loaded (epoch s)."""

    version: int
    session: Any
    tables: dict[str, np.ndarray]
    inputs: list[str]
    outputs: list[str]
    loaded_at: float
    applied: list[int] = field(default_factory=list)  # the deltas applied to reach it from what was served


class RepositoryPredictor:
    """The serving core, without KServe: load the newest version (incrementally where possible) and predict."""

    def __init__(self, repository: str, name: str, storage_options: dict[str, Any] | None = None) -> None:
        self.repo = ModelRepository(repository, name, storage_options)
        self.current: Loaded | None = None
        self._lock = threading.Lock()

    def refresh(self) -> bool:
        """Load the newest published version if it is not the one served; True if one was loaded."""
        versions = self.repo.versions()
        if not versions or (self.current is not None and self.current.version == versions[-1]):
            return False
        loaded = self._load(versions[-1])
        with self._lock:
            self.current = loaded
        log.info("serving %s version %d (deltas applied: %s)", self.repo.name, loaded.version, loaded.applied)
        return True

    def _load(self, version: int) -> Loaded:
        import onnxruntime as ort

        chain = self.repo.chain(version)
        served = self.current
        steps = [i.version for i in chain]
        applied: list[int] = []
        if served is not None and served.tables and served.version in steps:
            tables = {k: v.copy() for k, v in served.tables.items()}  # requests keep reading the served copy
            for info in chain[steps.index(served.version) + 1 :]:
                apply_delta(tables, load_arrays(self.repo.read(info.version, DELTA_FILE)))
                applied.append(info.version)
        else:
            tables = read_tables(self.repo, version)
        info = chain[-1]
        opts = ort.SessionOptions()
        opts.log_severity_level = 3
        opts.intra_op_num_threads = 1
        session = ort.InferenceSession(self.repo.read(version, MODEL_FILE), opts, providers=["CPUExecutionProvider"])
        feeds = [i for i in info.inputs if i not in tables]
        return Loaded(version, session, tables, feeds, info.outputs, time.time(), applied)

    def predict(self, inputs: dict[str, np.ndarray]) -> tuple[int, dict[str, np.ndarray]]:
        """Run the served version on ``inputs`` (by input name); returns its version and outputs by name."""
        with self._lock:
            loaded = self.current
        if loaded is None:
            raise ServingError(f"{self.repo.name}: no version is published in {self.repo.storage.root} yet")
        missing = [n for n in loaded.inputs if n not in inputs]
        if missing:
            raise ServingError(f"{self.repo.name}: the request lacks inputs {missing} (the model takes "
                               f"{loaded.inputs})")  # fmt: skip
        outs = loaded.session.run(loaded.outputs, {**{n: inputs[n] for n in loaded.inputs}, **loaded.tables})
        return loaded.version, dict(zip(loaded.outputs, outs, strict=True))


def _bind_to(host: str) -> None:
    """KServe 0.21 hard-codes uvicorn's host to 0.0.0.0: bind to ``host`` instead (this process only serves)."""
    import uvicorn

    base = uvicorn.Config

    class Config(base):  # type: ignore[misc,valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            kwargs["host"] = host
            super().__init__(*args, **kwargs)

    uvicorn.Config = Config


def serve(repository: str, name: str, http_port: int, poll: float, host: str = "127.0.0.1") -> None:
    """Start KServe's ModelServer with the repository's model once a version is published; blocks."""
    import kserve

    _bind_to(host)

    predictor = RepositoryPredictor(repository, name)
    stop = threading.Event()

    class RepositoryModel(kserve.Model):
        def __init__(self) -> None:
            super().__init__(name)
            self.ready = False

        def load(self) -> bool:
            self._refresh()
            threading.Thread(target=self._poll, name="repository-poll", daemon=True).start()
            return True

        def _refresh(self) -> None:
            try:
                predictor.refresh()
            except (ServingError, BrokenChainError, OSError) as exc:  # a version being retired or removed
                log.warning("version not loaded: %s", exc)
            self.ready = predictor.current is not None

        def _poll(self) -> None:
            while not stop.wait(poll):  # the repository is polled, as Triton's POLL mode does
                self._refresh()

        async def predict(self, payload: Any, headers: Any = None, response_headers: Any = None) -> dict[str, Any]:
            if isinstance(payload, (bytes, bytearray)):  # a body sent without a JSON content type
                payload = json.loads(payload)
            rows = payload["instances"]
            inputs = {k: np.asarray([row[k] for row in rows]) for k in rows[0]}
            with predictor._lock:
                loaded = predictor.current
            if loaded is not None:  # cast to what the graph declares (JSON numbers arrive as int64/float64)
                for meta in loaded.session.get_inputs():
                    if meta.name in inputs:
                        inputs[meta.name] = inputs[meta.name].astype(_ORT_TYPES.get(meta.type, np.float32))
            version, outs = predictor.predict(inputs)
            first = next(iter(outs.values()))
            return {"predictions": first.tolist(), "model_version": str(version),
                    "loaded_at": predictor.current.loaded_at if predictor.current else None}  # fmt: skip

    model = RepositoryModel()
    model.load()
    while not model.ready:  # KServe registers only a ready model: wait for the first version
        log.info("waiting for a first version of %s in %s", name, repository)
        stop.wait(poll)
        model._refresh()
    kserve.ModelServer(http_port=http_port, workers=1, enable_grpc=False).start([model])
    stop.set()


_ORT_TYPES = {"tensor(int64)": np.int64, "tensor(int32)": np.int32, "tensor(float)": np.float32,
              "tensor(double)": np.float64}  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--repository", required=True, help="the model repository (a directory or an fsspec URL)")
    p.add_argument("--name", required=True, help="the model's name in it")
    p.add_argument("--http-port", type=int, default=8080)
    p.add_argument("--host", default="127.0.0.1", help="interface to bind (off loopback, put TLS in front)")
    p.add_argument("--poll", type=float, default=1.0, help="seconds between polls of the repository")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    serve(args.repository, args.name, args.http_port, args.poll, args.host)


if __name__ == "__main__":
    main()
