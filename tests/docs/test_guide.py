"""The user guide (docs/guide/*.md) runs: every fenced block is run, parsed, or marked with why it is not.

Python blocks run in a fresh interpreter per session, bash blocks with bash, against real things: a master
process, the tansu broker (Kafka protocol), files in a temporary directory. YAML job specs are validated
against the job spec model, Prometheus rules against the master's metric names. See tests/docs/blocks.py for
the marks (``session``, ``file``, ``not run``).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from streamrover.operator.spec import parse_spec
from streamrover.testing.procs import MasterProcess
from tests.docs.blocks import GUIDE, PARSED, RUN, Block, pages, parse
from tests.docs.runner import Session
from tests.helpers import end_processes_under

ROOT = GUIDE.parents[1]
# What a page's blocks are given (beside a working directory): "master" (STREAMROVER_MASTER, STREAMROVER_TOKEN,
# STATE_DIR with its token file), "kafka" (KAFKA: a tansu broker's bootstrap address) and "ray" (a Ray temp
# directory of the test's own, RAY_TMPDIR, whose processes end with the test: `ray stop` would end every Ray).
NEEDS: dict[str, set[str]] = {
    "sources.md": {"master", "kafka"},
    "checkpoints.md": {"master"},
    "operations.md": {"master"},
    "troubleshooting.md": {"master"},
    "quickstart.md": {"kafka"},
    "ray.md": {"ray"},
}
# Pages whose blocks another test runs, against what it starts (kubernetes.md: a control plane, with kubectl).
RUN_ELSEWHERE = {"kubernetes.md": "tests/operator/k8s/test_k8s_guide.py"}


def metric_names() -> set[str]:
    """Every metric the master exposes, read from its collector's source (counters with ``_total``)."""
    (source,) = [p for p in (ROOT / "streamrover" / "shard_service").rglob("metrics.py")
                 if "class JobCollector" in p.read_text()]  # fmt: skip  (wherever the master's side keeps it)
    text = source.read_text()
    names = set(re.findall(r'_gauge(?:_value)?\(\s*"(\w+)"', text))
    names |= set(re.findall(r'GaugeMetricFamily\(\s*f"\{PREFIX\}_(\w+)"', text))
    counters = {f"{n}_total" for n in re.findall(r'CounterMetricFamily\(\s*f"\{PREFIX\}_(\w+)"', text)}
    return {f"streamrover_{n}" for n in names | counters}


def check_parsed(block: Block) -> None:
    """A YAML/JSON/TOML block parses; a job spec validates against the model, alert rules name real metrics."""
    if block.lang == "json":
        json.loads(block.code)
        return
    if block.lang == "toml":
        import tomllib  # Python 3.11+ (the suite's interpreter)

        tomllib.loads(block.code)
        return
    for doc in yaml.safe_load_all(block.code):
        if isinstance(doc, dict) and "trainer" in doc and "datasets" in doc:
            parse_spec(doc, block.where)
        elif isinstance(doc, dict) and "groups" in doc:
            known = metric_names()
            for group in doc["groups"]:
                for rule in group["rules"]:
                    assert rule.get("alert") and rule.get("expr"), f"{block.where}: a rule needs alert and expr"
                    used = set(re.findall(r"streamrover_\w+", rule["expr"]))
                    assert used <= known, f"{block.where}: {rule['alert']} uses unknown metrics {used - known}"


def test_the_pages_run_elsewhere_are_run_there() -> None:
    """Each page of :data:`RUN_ELSEWHERE` is named by the test that runs it (so neither can drift alone)."""
    for page, test in RUN_ELSEWHERE.items():
        assert (GUIDE / page).exists() and f'"{page}"' in (ROOT / test).read_text(), (page, test)


def test_every_block_is_run_or_marked_with_a_reason() -> None:
    """A block that is neither run nor parsed says why in a ``not run`` mark; file marks name a file."""
    problems = []
    blocks = [b for page in pages() for b in parse(page)]
    assert len(blocks) > 20, "the guide has hardly any code blocks: is docs/guide/ there?"
    for b in blocks:
        if b.not_run is not None and len(b.not_run) < 15:
            problems.append(f"{b.where}: 'not run' needs a reason (what it needs, what covers it instead)")
        if b.not_run is None and b.file is None and b.lang not in RUN + PARSED:
            problems.append(f"{b.where}: a ```{b.lang or '(no language)'} block is not run: mark it not run, "
                            "with the reason")  # fmt: skip
    assert not problems, "\n".join(problems)


@pytest.fixture
def page_env(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[dict[str, str]]:
    """The environment a page's blocks run in (see NEEDS), with the processes it needs started."""
    page = request.param
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONPATH"] = str(ROOT)
    env["STREAMROVER_HOME"] = str(tmp_path / "jobs")
    env["PYTHONUNBUFFERED"] = "1"
    for key in ("STREAMROVER_MASTER", "STREAMROVER_TOKEN", "KAFKA"):
        env.pop(key, None)
    needs = NEEDS.get(page, set())
    if "kafka" in needs:
        env["KAFKA"] = request.getfixturevalue("tansu_broker").bootstrap
    ray_temp = None
    if "ray" in needs:
        ray_temp = Path(tempfile.mkdtemp(prefix="rayd"))  # short: Ray's socket paths live under it
        env.pop("RAY_ADDRESS", None)
        env.update(RAY_TMPDIR=str(ray_temp), RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0")  # 127.0.0.1 only
    master = None
    if "master" in needs:
        master = MasterProcess(tmp_path / "master-state", lease_ttl=5.0)
        token = master.state_dir / "token"
        token.write_text(master.token + "\n")
        token.chmod(0o600)
        master.start()
        env.update(STREAMROVER_MASTER=master.address, STREAMROVER_TOKEN=master.token, STATE_DIR=str(master.state_dir))
    try:
        yield env
    finally:
        if master is not None:
            master.stop()
        if ray_temp is not None:
            end_processes_under(ray_temp)
            shutil.rmtree(ray_temp, ignore_errors=True)


@pytest.mark.parametrize("page_env", [p.name for p in pages() if p.name not in RUN_ELSEWHERE], indirect=True)
def test_page_runs(page_env: dict[str, str], tmp_path: Path, request: Any) -> None:
    """Every block of the page in order: run (bash, Python), written (file marks) or parsed (specs)."""
    page = request.node.callspec.params["page_env"]
    sessions: dict[str, Session] = {}
    try:
        for n, block in enumerate(parse(GUIDE / page)):
            if block.not_run is not None:
                continue
            if block.lang in PARSED and not block.file:
                check_parsed(block)
                continue
            name = block.session or f"block{n}"
            if name not in sessions:
                cwd = tmp_path / f"session-{name}"
                cwd.mkdir()
                sessions[name] = Session(name, cwd, page_env)
            sessions[name].run(block)
            if block.file and block.lang == "yaml":
                check_parsed(block)
    finally:
        for session in sessions.values():
            session.close()


def test_the_metrics_table_names_every_metric_the_master_exposes() -> None:
    """operations.md's metrics table lists exactly the metrics in the master's collector."""
    text = (GUIDE / "operations.md").read_text()
    listed = set(re.findall(r"^\| `(streamrover_\w+)`", text, re.MULTILINE))
    known = metric_names()
    assert len(known) > 20
    assert listed == known, f"missing from the guide: {sorted(known - listed)}; not exposed: {sorted(listed - known)}"


def test_the_options_table_is_generated_from_the_option_models() -> None:
    """sources.md's sr.* table comes from streamrover/sources/options.py at build time (docs/hooks.py)."""
    sys.path.insert(0, str(ROOT / "docs"))
    try:
        import hooks  # type: ignore[import-not-found]
    finally:
        sys.path.remove(str(ROOT / "docs"))
    markdown = hooks.expand((GUIDE / "sources.md").read_text())
    assert "<!-- options:" not in markdown
    from streamrover.sources.options import KafkaOptions, PulsarOptions, RocketMQOptions

    for model in (KafkaOptions, PulsarOptions, RocketMQOptions):
        for key in model.accepted():
            assert f"`{key}`" in markdown, f"{key} of {model.__name__} is not in the generated table"
