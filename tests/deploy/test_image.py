"""The operator image, checked without a container engine (none runs on this project's machines).

``make image`` builds ``deploy/docker/Dockerfile`` from the repository root, with BuildKit's per-Dockerfile
ignore file ``deploy/docker/Dockerfile.dockerignore``. What can break it here is checked here: every ``COPY``
source is in the repository and not excluded by the ignore file (as BuildKit reads it: the last matching
pattern wins, a pattern matches a path or any of its parent directories), what ``pip install .`` of the copied
tree needs is copied, and the version agrees everywhere the image's tag is written.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

import streamrover
from streamrover.operator.k8s import K8sConfig

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "deploy" / "docker" / "Dockerfile"
IGNORE = DOCKERFILE.with_name("Dockerfile.dockerignore")


def _patterns() -> list[tuple[bool, str]]:
    """(excludes, pattern) of the ignore file, in order."""
    out = []
    for line in IGNORE.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            negated = line.startswith("!")
            out.append((not negated, line.lstrip("!").strip("/")))
    return out


def _matches(pattern: str, path: str) -> bool:
    parts = path.split("/")
    candidates = ["/".join(parts[: i + 1]) for i in range(len(parts))]  # the path and its parent directories
    regex = re.escape(pattern).replace(r"\*\*/", "(.*/)?").replace(r"\*\*", ".*").replace(r"\*", "[^/]*")
    regex = regex.replace(r"\?", "[^/]")
    return any(re.fullmatch(regex, c) for c in candidates)


def in_context(path: str) -> bool:
    """Whether the build context holds ``path`` (relative to the repository root)."""
    included = True
    for excludes, pattern in _patterns():
        if _matches(pattern, path):
            included = not excludes
    return included


def _copy_sources() -> list[str]:
    sources = []
    for line in DOCKERFILE.read_text().splitlines():
        words = line.split()
        if words and words[0].upper() in ("COPY", "ADD") and not any(w.startswith("--from") for w in words):
            sources += [w for w in words[1:-1] if not w.startswith("--")]
    return sources


def _project() -> dict[str, Any]:
    import tomllib  # Python 3.11+ (the suite's interpreter)

    return dict(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"])


def test_the_ignore_file_is_read_as_buildkit_reads_it() -> None:
    assert in_context("pyproject.toml") and in_context("streamrover/operator/k8s.py")
    assert not in_context("tests/helpers.py") and not in_context("streamrover/__pycache__/x.pyc")
    assert not in_context("docs/guide/index.md") and not in_context("Makefile")  # `*` excludes the rest


def test_the_build_context_holds_everything_the_dockerfile_copies() -> None:
    sources = _copy_sources()
    assert "streamrover" in sources and "pyproject.toml" in sources, sources
    for source in sources:
        assert (ROOT / source).exists(), f"COPY {source}: not in the repository"
        assert in_context(source), f"COPY {source}: excluded from the build context by {IGNORE.name}"
        if (ROOT / source).is_dir():
            files = [p.relative_to(ROOT).as_posix() for p in (ROOT / source).rglob("*") if p.is_file()
                     and "__pycache__" not in p.parts]  # fmt: skip
            left_out = [f for f in files if not in_context(f)]
            assert not left_out, f"COPY {source}: {len(left_out)} files left out of the context: {left_out[:5]}"
    # `pip install .` of the copied tree reads these
    project = _project()
    needed = [project["readme"], *project.get("license-files", [])]
    for name in needed:
        assert name in sources and in_context(name), f"pyproject.toml needs {name}: the Dockerfile must COPY it"
    schema = "streamrover/operator/jobspec.schema.json"  # package data the operator reads
    assert (ROOT / schema).exists() and in_context(schema)


def test_the_image_tag_is_the_package_version_everywhere() -> None:
    version = _project()["version"]
    assert streamrover.__version__ == version
    tag = f"streamrover:{version}"
    assert K8sConfig.image == tag
    assert f'org.opencontainers.image.version="{version}"' in DOCKERFILE.read_text()
    deployment = yaml.safe_load((ROOT / "deploy" / "k8s" / "30-operator.yaml").read_text())
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert container["image"] == tag and env["STREAMROVER_K8S_IMAGE"] == tag, container
    assert "IMAGE ?= streamrover:$(VERSION)" in (ROOT / "Makefile").read_text()
