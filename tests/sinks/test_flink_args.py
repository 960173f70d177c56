"""streamrover.sinks.flink refuses bad arguments before it touches PyFlink (the main venv has no pyflink)."""

from __future__ import annotations

import re

import pytest

from streamrover.sinks.flink import JAR_ENV, TrainingSink, sink_jar


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"staging_dir": "relative/staging"}, "staging_dir must be an absolute local path or a file:// URL"),
        ({"staging_dir": "s3://bucket/staging"}, "not 's3://bucket/staging'"),
        ({"staging_dir": "/shared/staging", "rows_per_file": 0}, "rows_per_file must be > 0, not 0"),
    ],
)
def test_bad_arguments_are_named(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        TrainingSink("127.0.0.1:1", "clicks", token="t", **kwargs)  # type: ignore[arg-type]


def test_a_missing_jar_says_how_to_build_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(JAR_ENV, "/nonexistent/sink.jar")
    with pytest.raises(FileNotFoundError, match="make flink-sink"):
        sink_jar()
