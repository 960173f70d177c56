"""The job spec: one YAML file that says what a job runs, on any platform (``streamrover run job.yaml``).

A typed model (pydantic), its JSON schema published beside it (``jobspec.schema.json``,
regenerated with ``python -m streamrover.operator.spec --schema``) and errors that name
the bad field (``trainer.nodes: ...``). Example::

    name: ledger
    master: {port: 0}                      # state_dir defaults to the job's directory
    datasets:
      - name: stream
        uri: kafka://127.0.0.1:9092/clicks
        records_per_shard: 2000
        options: {sr.format: json, sr.schema: "id:int64,x:float64"}
    trainer:
      kind: torch                          # dlrover-run; tf-ps roles come later
      script: train.py                     # relative paths are relative to this file
      args: [--records, "200000"]
      nproc_per_node: 2
      nodes: "1:3"                         # MIN:MAX (a single number: fixed)
      memory: 2Gi                          # per node (Kubernetes quantities)
    checkpoint: {url: ckpt, every_steps: 10, keep_last: 3}
    restart: {per_node: 3, per_job: 10, oom: {factor: 1.5, max_memory: 8Gi}}
    autoscaling: {target_lag_records: 50000, cooldown_seconds: 60, min_nodes: 1, max_nodes: 3}
    health: {node_check: true, straggler_policy: replace, hang_timeout_seconds: 30}

Memory and CPU sizes are ``quantities.py``'s. Nothing here imports anything heavier than pydantic and PyYAML.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, field_validator, model_validator

from streamrover.operator.api import PlatformError
from streamrover.operator.quantities import Cpu, Memory, format_memory
from streamrover.operator.quantities import parse_cpu as parse_cpu  # re-exported: defined here before
from streamrover.operator.quantities import parse_memory as parse_memory  # re-exported: defined here before

SCHEMA_PATH = Path(__file__).with_name("jobspec.schema.json")
_NAME = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")  # a DNS label: a Kubernetes object name too


class SpecError(PlatformError, ValueError):
    """The job spec is not valid; ``problems`` lists ``(field path, message)`` pairs."""

    def __init__(self, source: str, problems: list[tuple[str, str]]) -> None:
        self.source = source
        self.problems = problems
        lines = "\n".join(f"  {where}: {what}" for where, what in problems)
        super().__init__(f"{source}: invalid job spec\n{lines}")


def _stringify(value: Any) -> Any:
    """Source options are strings (librdkafka style); YAML numbers and booleans are taken as written."""
    if isinstance(value, dict):
        return {k: (str(v).lower() if isinstance(v, bool) else str(v)) if isinstance(v, (int, float, bool)) else v
                for k, v in value.items()}  # fmt: skip
    return value


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class TokenSource(_Model):
    """Where the job's bearer token comes from: a file, an environment variable, or (neither) generated."""

    file: str | None = Field(None, description="read the token from this file")
    env: str | None = Field(None, description="read the token from this environment variable")

    @model_validator(mode="after")
    def _one(self) -> TokenSource:
        if self.file and self.env:
            raise ValueError("give the token as file or env, not both")
        return self


class TlsSpec(_Model):
    """TLS for the master: files on the machine it runs on (local, Ray) or, on Kubernetes, Secrets in cert-manager's
    layout (``tls.crt``, ``tls.key``, ``ca.crt``) the operator mounts: see the guide's security page."""

    cert: str | None = Field(None, description="the master's certificate (PEM), for gRPC and the dashboard")
    key: str | None = Field(None, description="its private key (PEM)")
    ca: str | None = Field(None, description="the CA the controller and the trainers verify the master by")
    client_ca: str | None = Field(None, description="mutual TLS: clients must present a certificate it signed")
    client_cert: str | None = Field(None, description="the certificate the controller and trainers present")
    client_key: str | None = Field(None, description="its key (PEM, PKCS#8 for the Java Flink committer)")
    secret: str | None = Field(None, description="Kubernetes: the Secret of the master's certificate (tls.crt, "
                               "tls.key, ca.crt), for the name <job>-master.<namespace>.svc; in place of the files")
    client_secret: str | None = Field(None, description="Kubernetes, mutual TLS: the Secret of the job's client "
                                      "certificate (same layout); the master requires certificates its ca.crt signed")

    @model_validator(mode="after")
    def _client_pair(self) -> TlsSpec:
        files = {k: v for k, v in self.model_dump().items() if v and not k.endswith("secret")}
        if self.secret:
            if files:
                raise ValueError(f"give the Secret or the files, not both (secret with {', '.join(files)})")
            return self
        if self.client_secret:
            raise ValueError("client_secret goes with secret (Kubernetes)")
        missing = [k for k in ("cert", "key", "ca") if not getattr(self, k)]
        if missing:
            raise ValueError(f"{', '.join(missing)} missing: give cert, key and ca (files), or secret (Kubernetes)")
        if bool(self.client_cert) != bool(self.client_key):
            raise ValueError("client_cert and client_key go together")
        if self.client_ca and not self.client_cert:
            raise ValueError("client_ca (mutual TLS) needs client_cert and client_key for the job's own clients")
        return self

    def master_args(self) -> tuple[str, ...]:
        """The ``streamrover master`` flags (the files; a Secret's are the Kubernetes platform's)."""
        if self.secret or not self.cert or not self.key:
            raise PlatformError(f"master.tls.secret {self.secret!r} is a Kubernetes Secret: on this platform give "
                                "master.tls.cert, key and ca (files)")  # fmt: skip
        extra = ("--tls-client-ca", self.client_ca) if self.client_ca else ()
        return ("--tls-cert", self.cert, "--tls-key", self.key, *extra)


class MasterSpec(_Model):
    """The job master (shard service)."""

    state_dir: str | None = Field(None, description="its durable journal; default: the job's directory/master")
    host: str = Field("127.0.0.1", description="interface it binds")
    port: int = Field(0, ge=0, le=65535, description="0 picks a free port")
    token: TokenSource = Field(default_factory=lambda: TokenSource(), description="default: generated, 0600 file")
    lease_ttl: float = Field(10.0, gt=0, description="seconds a lease lives without a heartbeat")
    tls: TlsSpec | None = Field(None, description="serve TLS (needed when host is not loopback)")


class DatasetEntry(_Model):
    """A dataset as ``streamrover dataset add`` takes it."""

    name: str = Field(min_length=1)
    uri: str = Field(min_length=1, description="path, glob, fsspec URL, kafka://, pulsar://, rocketmq://")
    format: Literal["", "parquet", "csv", "jsonl"] = ""
    options: Annotated[dict[str, str], BeforeValidator(_stringify)] = Field(default_factory=dict)
    records_per_shard: int = Field(0, ge=0)
    epochs: int = Field(1, ge=1)
    shuffle: bool = False
    seed: int = 0


def _nodes(value: Any) -> Any:
    if isinstance(value, bool):
        raise ValueError("MIN:MAX or a number")
    if isinstance(value, int):
        return {"min": value, "max": value}
    if isinstance(value, str):
        lo, sep, hi = value.partition(":")
        try:
            return {"min": int(lo), "max": int(hi if sep else lo)}
        except ValueError:
            raise ValueError(f"{value!r} is not MIN:MAX (like 1:3) or a number") from None
    return value


class NodeRange(_Model):
    """How many nodes (agents): ``MIN:MAX`` in YAML."""

    min: int = Field(ge=1)
    max: int = Field(ge=1)

    @model_validator(mode="after")
    def _ordered(self) -> NodeRange:
        if self.min > self.max:
            raise ValueError(f"MIN {self.min} is more than MAX {self.max}")
        return self

    def __str__(self) -> str:
        return f"{self.min}:{self.max}"


class TorchTrainer(_Model):
    """A torch script under ``dlrover-run`` (torchrun's flags, elastic between MIN and MAX nodes)."""

    kind: Literal["torch"] = "torch"
    script: str = Field(min_length=1, description="the training script (relative to the spec file)")
    args: list[str] = Field(default_factory=list, description="the script's arguments")
    nproc_per_node: int = Field(1, ge=1, description="worker processes per node")
    nodes: Annotated[NodeRange, BeforeValidator(_nodes)] = Field(default_factory=lambda: NodeRange(min=1, max=1))
    cpu: Cpu | None = Field(None, description="cores per node")
    memory: Memory | None = Field(None, description="memory per node (enforced where the platform can)")
    launcher_args: list[str] = Field(default_factory=list, description="more dlrover-run (torchrun) flags")
    env: Annotated[dict[str, str], BeforeValidator(_stringify)] = Field(default_factory=dict)

    @field_validator("args", "launcher_args", mode="before")
    @classmethod
    def _strings(cls, value: Any) -> Any:
        return [str(v) for v in value] if isinstance(value, list) else value


class CheckpointSpec(_Model):
    """Flash checkpoints: where they persist, how often, how many are kept."""

    url: str | None = Field(None, description="directory or fsspec URL; default: the job's directory/ckpt")
    every_steps: int = Field(50, ge=1)
    keep_last: int = Field(3, ge=1)


class ExportSpec(_Model):
    """Serving exports (streamrover.serving): every durable checkpoint becomes a version of ``name`` in ``repository``.

    The trainer script builds its exporter from it (``ExportConfig.from_env()``): the model factory and
    example inputs are the script's."""

    repository: str = Field(description="model repository: a directory or an fsspec URL (Triton's layout)")
    name: str = Field("model", description="the model's name in the repository")
    keep_last: int = Field(5, ge=1, description="versions kept (with the delta chains they need)")
    base_every: int = Field(10, ge=1, description="with tracked embedding tables: a full base every N versions")


class OomPolicy(_Model):
    """A node the OOM killer hit is relaunched with ``factor`` times its memory, up to ``max_memory``."""

    factor: float = Field(1.5, gt=1.0)
    max_memory: Memory | None = Field(None, description="default: 4x the node's memory")


class RestartPolicy(_Model):
    """Restarts: workers in place (per node, by dlrover-run), nodes relaunched (per job, by the supervisor)."""

    per_node: int = Field(3, ge=0, description="worker-group restarts inside one node (dlrover-run --max-restarts)")
    per_job: int = Field(10, ge=0, description="node relaunches over the job's life")
    heartbeat_timeout: float = Field(120.0, gt=0, description="seconds of agent silence before a node counts lost")
    oom: OomPolicy = Field(default_factory=lambda: OomPolicy())


class HealthSpec(_Model):
    """Node health: a pre-flight node check, straggler detection (and replacement), hung-collective restarts."""

    node_check: bool = Field(False, description="check every node (matmul, gloo all-reduce) before it joins")
    node_check_threshold: float = Field(2.0, gt=1.0, description="a node whose compute probe is slower than this "
                                        "times the other nodes' median fails the check and is relaunched")
    straggler_threshold: float = Field(2.0, gt=1.0, description="a node whose busy seconds per step exceed this "
                                       "times the other nodes' median ...")
    straggler_window_seconds: float = Field(30.0, ge=0, description="... for this long is a straggler")
    straggler_policy: Literal["report", "replace"] = Field(
        "report", description="report: status, /metrics and the dashboard show it; replace: also relaunch it as a "
        "new node (the old one leaves gracefully; the group resumes from the newest checkpoint)")
    hang_timeout_seconds: float = Field(30.0, ge=0, description="a worker without progress this long is hung: its "
                                        "node's agent restarts the group (0: off)")


class AutoscalingSpec(_Model):
    """Node count from consumer lag: aim at a lag (records) or a freshness (seconds) within MIN:MAX."""

    target_lag_records: int | None = Field(None, gt=0)
    target_freshness_seconds: float | None = Field(None, gt=0)
    cooldown_seconds: float = Field(60.0, ge=0)
    min_nodes: int | None = Field(None, ge=1, description="default: trainer.nodes MIN")
    max_nodes: int | None = Field(None, ge=1, description="default: trainer.nodes MAX")

    @model_validator(mode="after")
    def _one_target(self) -> AutoscalingSpec:
        if (self.target_lag_records is None) == (self.target_freshness_seconds is None):
            raise ValueError("give exactly one of target_lag_records and target_freshness_seconds")
        if self.min_nodes and self.max_nodes and self.min_nodes > self.max_nodes:
            raise ValueError(f"min_nodes {self.min_nodes} is more than max_nodes {self.max_nodes}")
        return self


class JobSpec(_Model):
    """One streamrover job: its master, datasets, trainer, checkpoints, restarts and scaling."""

    model_config = ConfigDict(extra="forbid", frozen=True, title="streamrover job spec")

    name: str = Field(description="a DNS label: lower-case letters, digits and '-'")
    master: MasterSpec = Field(default_factory=lambda: MasterSpec())
    datasets: list[DatasetEntry] = Field(min_length=1)
    trainer: TorchTrainer
    checkpoint: CheckpointSpec = Field(default_factory=lambda: CheckpointSpec())
    export: ExportSpec | None = None
    restart: RestartPolicy = Field(default_factory=lambda: RestartPolicy())
    autoscaling: AutoscalingSpec | None = None
    health: HealthSpec = Field(default_factory=lambda: HealthSpec())

    @field_validator("name")
    @classmethod
    def _dns(cls, value: str) -> str:
        if not _NAME.match(value):
            raise ValueError(f"{value!r} is not a DNS label (lower-case letters, digits, '-'; at most 63)")
        return value

    @field_validator("datasets")
    @classmethod
    def _unique(cls, value: list[DatasetEntry]) -> list[DatasetEntry]:
        seen: set[str] = set()
        for ds in value:
            if ds.name in seen:
                raise ValueError(f"dataset name {ds.name!r} appears twice")
            seen.add(ds.name)
        return value

    @model_validator(mode="after")
    def _bounds(self) -> JobSpec:
        nodes, scaling = self.trainer.nodes, self.autoscaling
        for field in ("min_nodes", "max_nodes"):
            n = getattr(scaling, field, None) if scaling else None
            if n is not None and not nodes.min <= n <= nodes.max:
                raise ValueError(f"autoscaling.{field} {n} is outside trainer.nodes {nodes}")
        mem, ceiling = self.trainer.memory, self.restart.oom.max_memory
        if mem and ceiling and ceiling < mem:
            raise ValueError(f"restart.oom.max_memory {format_memory(ceiling)} is below trainer.memory")
        return self

    @property
    def scale_bounds(self) -> tuple[int, int]:
        """The node counts autoscaling and ``scale`` may choose from."""
        s = self.autoscaling
        return ((s.min_nodes if s and s.min_nodes else self.trainer.nodes.min),
                (s.max_nodes if s and s.max_nodes else self.trainer.nodes.max))  # fmt: skip

    @property
    def memory_ceiling(self) -> int | None:
        """The most memory an OOM relaunch may give a node."""
        if self.restart.oom.max_memory:
            return self.restart.oom.max_memory
        return 4 * self.trainer.memory if self.trainer.memory else None


def _location(loc: tuple[Any, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part in ("function-before[_nodes(), NodeRange]",) or str(part).startswith("function-"):
            continue
        else:
            out += f".{part}" if out else str(part)
    return out or "(top level)"


def _problems(exc: ValidationError) -> list[tuple[str, str]]:
    out = []
    for err in exc.errors(include_url=False):
        where = _location(tuple(err["loc"]))
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            msg = "unknown field (check its spelling)"
        elif err["type"] == "missing":
            msg = "required field missing"
        out.append((where, msg))
    return out


def parse_spec(data: Any, source: str = "job spec", base: Path | None = None) -> JobSpec:
    """Validate a spec's data (the YAML document); relative paths resolve against ``base``."""
    if not isinstance(data, dict):
        raise SpecError(source, [("(top level)", "the spec must be a mapping of fields (name, datasets, trainer...)")])
    try:
        spec = JobSpec.model_validate(data)
    except ValidationError as exc:
        raise SpecError(source, _problems(exc)) from None
    return _resolved(spec, base) if base is not None else spec


def _resolved(spec: JobSpec, base: Path) -> JobSpec:
    def path(p: str | None) -> str | None:
        if p is None or "://" in p:
            return p
        return str((base / p).resolve()) if not Path(p).is_absolute() else p

    master = spec.master.model_copy(update={"state_dir": path(spec.master.state_dir)})
    trainer = spec.trainer.model_copy(update={"script": path(spec.trainer.script)})
    ckpt = spec.checkpoint.model_copy(update={"url": path(spec.checkpoint.url)})
    datasets = [ds.model_copy(update={"uri": path(ds.uri)}) for ds in spec.datasets]
    export = spec.export.model_copy(update={"repository": path(spec.export.repository)}) if spec.export else None
    return spec.model_copy(
        update={"master": master, "trainer": trainer, "checkpoint": ckpt, "datasets": datasets, "export": export}
    )


def load_spec(path: str | Path, resolve: bool = True) -> JobSpec:
    """Read and validate a job spec file; a :class:`SpecError` names each bad field.

    Relative paths (``trainer.script``, ``checkpoint.url``, ``master.state_dir``, dataset ``uri``,
    ``export.repository``) resolve against the file's directory unless ``resolve`` is False (Kubernetes:
    :mod:`streamrover.operator.k8s_files`).
    """
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise SpecError(str(path), [("(file)", f"cannot read it: {exc.strerror or exc}")]) from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}" if mark else "(file)"
        raise SpecError(str(path), [(where, f"not valid YAML: {getattr(exc, 'problem', None) or exc}")]) from None
    return parse_spec(data, str(path), path.parent.resolve() if resolve else None)


def json_schema() -> dict[str, Any]:
    """The published JSON schema of the job spec."""
    schema = JobSpec.model_json_schema()
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    return schema


def schema_text() -> str:
    """The job spec's JSON schema as committed (``python -m streamrover.operator.spec --schema`` writes it)."""
    return json.dumps(json_schema(), indent=2, sort_keys=True) + "\n"


if __name__ == "__main__":  # python -m streamrover.operator.spec --schema: regenerate the committed schema
    if sys.argv[1:] == ["--schema"]:
        SCHEMA_PATH.write_text(schema_text())
        print(f"wrote {SCHEMA_PATH}")
    else:
        for arg in sys.argv[1:]:
            print(load_spec(arg).model_dump_json(indent=2))
