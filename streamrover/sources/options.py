"""Dataset options, parsed in one typed place per source before anything is journalled or any broker contacted.

A dataset's options are strings (``--option KEY=VALUE``). Those whose names start with
``sr.`` are streamrover's and are parsed here, by a pydantic model per source
(:class:`KafkaOptions`, :class:`PulsarOptions`, :class:`RocketMQOptions`, :class:`FileOptions`);
every other option belongs to the source's client (librdkafka settings, Pulsar client
arguments...) and is passed through by the backend. An unknown ``sr.`` key or a value that
does not parse raises :class:`OptionError`, naming the key, the value and the accepted forms.

Sources parse their options in their constructors, which do no I/O, so the master refuses a
bad option before it contacts a broker; the planning options every stream shares
(:class:`StreamPlanning`) are read by the master's planner and poller with :func:`planning_options`.
Adding an option is adding a field with an ``sr.`` alias and a description of its accepted forms.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from functools import lru_cache
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from streamrover.sources.api import SourceError

PREFIX = "sr."


class OptionError(SourceError):
    """A dataset option is unknown or its value is not one of the accepted forms."""


def _ms(alias: str, default: int | None, what: str, minimum: int = 0) -> Any:
    """An option that is an integer number of milliseconds (``minimum`` or more)."""
    return Field(
        default, ge=minimum, alias=alias, description=f"an integer number of milliseconds >= {minimum} ({what})"
    )


class _Options(BaseModel):
    """Base of the option models: strict names (``sr.`` aliases), frozen, unknown keys refused."""

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=False, hide_input_in_errors=True)

    @classmethod
    def parse(cls: type[M], options: Mapping[str, str], source: str = "", **implied: str) -> M:
        """The model of the ``sr.`` options in ``options`` (others are the client's); ``implied`` fills absent keys.

        Raises :class:`OptionError` naming every bad key, its value and the accepted forms.
        """
        ours = {k: v for k, v in options.items() if k.startswith(PREFIX)}
        for key, value in implied.items():
            if value:
                ours.setdefault(key, value)
        try:
            return cls.model_validate(ours)
        except ValidationError as exc:
            raise OptionError(_explain(cls, exc, ours, source or cls.__name__.removesuffix("Options"))) from None

    @classmethod
    def accepted(cls) -> dict[str, str]:
        """Each known option key and a description of its accepted forms."""
        return {f.alias or name: f.description or "" for name, f in cls.model_fields.items()}


M = TypeVar("M", bound=_Options)


def client_options(options: Mapping[str, str]) -> dict[str, str]:
    """The options that are not streamrover's (``sr.``): the source client's own configuration."""
    return {k: v for k, v in options.items() if not k.startswith(PREFIX)}


def _explain(model: type[_Options], exc: ValidationError, given: Mapping[str, str], source: str) -> str:
    known = model.accepted()
    problems = []
    for err in exc.errors():
        key = str(err["loc"][0]) if err["loc"] else ""
        value = given.get(key, "")
        if err["type"] == "extra_forbidden":
            close = difflib.get_close_matches(key, known, n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            names = ", ".join(sorted(known)) or "none"
            problems.append(f"unknown option {key}={value!r} for a {source} dataset{hint}; known options: {names}")
        elif key in known:
            msg = "not one of the accepted forms" if err["type"] == "string_pattern_mismatch" else err["msg"]
            problems.append(f"option {key}={value!r} is not valid: {msg}; accepted: {known[key]}")
        else:  # a check across options (model validator)
            problems.append(str(err["msg"]).removeprefix("Value error, "))
    return "; ".join(problems)


class StreamPlanning(_Options):
    """How the master plans a stream dataset's shards (every stream source takes these)."""

    model_config = ConfigDict(extra="ignore", frozen=True, populate_by_name=False, hide_input_in_errors=True)

    max_delay_ms: int = _ms("sr.max_delay_ms", 500, "how long records may wait before a partial shard is planned")
    max_pending_shards: int = Field(
        64, ge=1, alias="sr.max_pending_shards", description="an integer at least 1 (shards planned ahead, unleased)"
    )
    poll_interval_ms: int = _ms("sr.poll_interval_ms", 100, "how often the master polls the end positions", minimum=1)
    missing_grace_ms: int = _ms(
        "sr.missing_grace_ms", 120_000, "how long a missing topic or partition is waited for before the dataset fails"
    )
    source_timeout_ms: int = _ms(
        "sr.source_timeout_ms",
        60_000,
        "how long the master waits for one call to the source's client (a poll, a commit) before it abandons "
        "that client and opens a new one",
        minimum=1,
    )
    on_data_loss: Literal["fail", "skip"] = Field(
        "fail",
        alias="sr.on_data_loss",
        description="fail (records deleted upstream before they were trained fail the dataset) or skip (counted lost)",
    )
    max_skew_ms: int = _ms(
        "sr.max_skew_ms",
        60_000,
        "stream-time order: no shard is leased whose first record is more than this much stream time newer than the "
        "oldest shard not yet acked; 0 leases in time order without a bound",
    )


class _RecordOptions(StreamPlanning):
    """Options of stream sources that decode broker messages into records (serde.py)."""

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=False, hide_input_in_errors=True)

    format: Literal["raw", "json"] = Field(
        "raw", alias="sr.format", description="raw (payload bytes) or json (objects decoded into sr.schema)"
    )
    record_schema: str = Field(
        "", alias="sr.schema", description="comma-separated name:type, e.g. id:int64,x:float64 (with sr.format=json)"
    )
    dead_letter_dir: str = Field("", alias="sr.dead_letter_dir", description="a directory for undecodable records")

    @model_validator(mode="after")
    def _json_needs_schema(self) -> _RecordOptions:
        if self.format == "json":
            from streamrover.sources.serde import parse_schema

            try:
                parse_schema(self.record_schema)
            except SourceError as exc:
                raise ValueError(str(exc)) from None
        return self


class KafkaOptions(_RecordOptions):
    """``kafka://`` datasets (the other options are librdkafka configuration)."""

    start: str = Field(
        "earliest",
        alias="sr.start",
        pattern=r"^(earliest|latest|group|timestamp:[0-9]+)$",
        description="earliest, latest, group or timestamp:MILLIS",
    )
    dead_letter_topic: str = Field("", alias="sr.dead_letter_topic", description="a topic of the same cluster")


class _BrokerReadOptions(_RecordOptions):
    """Options of sources whose workers read from a broker that may be unreachable for a while."""

    read_timeout_ms: int | None = _ms(
        "sr.read_timeout_ms",
        None,
        "how long a shard read waits for an unreachable broker (default sr.missing_grace_ms)",
        minimum=1,
    )

    @property
    def read_timeout_s(self) -> float:
        """How long a worker's shard read waits for an unreachable broker: by default as long as the master waits
        for a missing topic (``sr.missing_grace_ms``), so a broker restart the master rides out does not make the
        workers give up first."""
        return (self.read_timeout_ms if self.read_timeout_ms is not None else self.missing_grace_ms) / 1000.0


class PulsarOptions(_BrokerReadOptions):
    """``pulsar://`` datasets (the other options are Pulsar client arguments)."""

    start: Literal["earliest", "latest"] = Field("earliest", alias="sr.start", description="earliest or latest")
    subscription: str = Field("", alias="sr.subscription", description="a subscription name")
    partition_reads: Literal["auto", "direct", "routed"] = Field(
        "auto", alias="sr.partition_reads", description="auto, direct or routed"
    )
    entry_bits: int = Field(24, ge=16, le=40, alias="sr.entry_bits", description="an integer from 16 to 40")
    reopen_ms: int = _ms("sr.reopen_ms", 500, "a silent reader is reopened after this long", minimum=1)
    receiver_queue_size: int = Field(
        1000, ge=1, alias="sr.receiver_queue_size", description="an integer at least 1 (messages per reader)"
    )


class RocketMQOptions(_BrokerReadOptions):
    """``rocketmq://`` datasets (the other options are client settings, see rocketmq.CLIENT_OPTIONS)."""

    start: Literal["earliest", "latest", "group"] = Field(
        "earliest", alias="sr.start", description="earliest, latest or group"
    )


class FileOptions(_Options):
    """Batch files take ``sr.on_data_loss``; ``cache_partitions`` (no prefix) is how many decoded files to keep."""

    cache_partitions: int = Field(2, ge=0, description="an integer >= 0 (decoded partitions kept in memory)")
    on_data_loss: Literal["fail", "skip"] = Field(
        "fail",
        alias="sr.on_data_loss",
        description="fail or skip: a file deleted before its records were trained fails the dataset, or with skip "
        "its untrained records are accounted as lost",
    )

    @classmethod
    def parse(cls: type[M], options: Mapping[str, str], source: str = "file", **implied: str) -> M:
        known = {"cache_partitions"}
        ours = {k: v for k, v in options.items() if k.startswith(PREFIX) or k in known}
        try:
            return cls.model_validate(ours)
        except ValidationError as exc:
            raise OptionError(_explain(cls, exc, ours, "batch file")) from None


@lru_cache(maxsize=1024)
def _planning(items: tuple[tuple[str, str], ...]) -> StreamPlanning:
    return StreamPlanning.parse(dict(items), "stream")


def planning_options(options: Mapping[str, str]) -> StreamPlanning:
    """The planning options of a stream dataset (parsed once per distinct set of options)."""
    return _planning(tuple(sorted(options.items())))


__all__ = [
    "FileOptions",
    "KafkaOptions",
    "OptionError",
    "PulsarOptions",
    "RocketMQOptions",
    "StreamPlanning",
    "client_options",
    "planning_options",
]
