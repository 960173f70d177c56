# streamrover: `make demo` runs the main job, `make test` the whole suite.
# Both set themselves up: virtualenv, the package with its extras, generated code checks.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# Extras the test suite needs; grows as issues land (kafka, torch, ...).
TEST_EXTRAS ?= dev,ckpt,s3,delta,iceberg,kafka,pulsar,rocketmq,torch,tf,platform,ray,k8s,ctr,spark,docs,serving,lightning,hf
# pyspark is published as a source distribution only (pure Python and its jars, nothing is compiled): it cannot be
# --only-binary; everything else that could backtrack into a failing source build is.
PIP_FLAGS ?= --disable-pip-version-check --progress-bar off --only-binary=torch,tensorflow-cpu,s3fs,aiobotocore,botocore,onnx,onnxruntime,ray,apache-beam,apache-flink,matplotlib,river,mkdocs,mkdocs-material,pyiceberg,sqlalchemy,pyroaring,mmh3,lightning,pytorch-lightning,transformers,accelerate,tokenizers
# The install's downloads are several GB (torch's CUDA wheels come with it from PyPI): a dropped connection resumes
# (pip >= 25.1, which the virtualenv's own upgrade brings) and the whole install is tried again (CI's run of
# 2026-12-05 lost a 151 MB wheel at 127.7 MB six times in a row and failed in 20 s).
PIP_NET_FLAGS ?= --resume-retries 30 --retries 10
# What a first install takes on disk (the virtualenv is ~9 GB, and pip unpacks beside it): checked up front,
# since pip out of space fails each of its tries after minutes (CI, 2026-12-05: a disk filled by other work).
INSTALL_GB ?= 11
comma := ,
STAMP := $(VENV)/.installed-$(subst $(comma),_,$(TEST_EXTRAS))
BENCH_STAMP := $(STAMP)-bench

.PHONY: setup install demo demo-backfill test lint docs bench clean proto jars browser k8s-build-start k8s seaweedfs-build-start seaweedfs flink-sink image serving-venv dlrover-venv

# The operator image (deploy/docker/Dockerfile), tagged with the package's version: the tag deploy/k8s names.
# Needs docker (BuildKit: it reads deploy/docker/Dockerfile.dockerignore) or podman; this project's CI machines
# have neither: tests/deploy/test_image.py checks the build context holds what the Dockerfile copies instead.
VERSION := $(shell sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml)
IMAGE ?= streamrover:$(VERSION)
CONTAINER_TOOL ?= $(shell command -v docker || command -v podman)

$(BIN)/python:
	@echo "make: creating the virtualenv $(VENV) ($(PYTHON) -m venv), once"
	@$(PYTHON) -m venv $(VENV)
	@$(BIN)/pip install $(PIP_FLAGS) -q --upgrade pip

$(STAMP): pyproject.toml streamrover/ckpt/_ntcopy.c | $(BIN)/python
	@echo "make: installing streamrover (editable) with the extras $(TEST_EXTRAS) into $(VENV);"
	@echo "      the first time takes minutes (torch, tensorflow, ray... are large), later runs skip this step"
	@free=$$(df -Pk $(VENV) | awk 'NR == 2 {print int($$4 / 1048576)}'); \
	if [ "$$free" -lt $(INSTALL_GB) ]; then \
	  echo "make: the install needs about $(INSTALL_GB) GB free on the disk of $(VENV) (the virtualenv takes 9 GB);" \
	    "$$free GB are free (df $(VENV)): free some space, or set VENV to a disk with more" >&2; exit 1; \
	fi
	@for try in 1 2 3 4; do \
	  $(BIN)/pip install $(PIP_FLAGS) $(PIP_NET_FLAGS) -q -e ".[$(TEST_EXTRAS)]" && break; \
	  if [ $$try = 4 ]; then echo "make: the install failed 4 times; giving up" >&2; exit 1; fi; \
	  echo "make: the install failed (try $$try of 4; what was downloaded stays in pip's cache); again in $$((try * 20)) s" >&2; \
	  sleep $$((try * 20)); \
	done
	@touch $@

install: $(STAMP)

$(BENCH_STAMP): $(STAMP)
	$(BIN)/pip install $(PIP_FLAGS) -q -e ".[$(TEST_EXTRAS),bench]"
	touch $@

# The flagship: online CTR from a live Kafka topic (embedded tansu), a worker SIGKILLed, a report.
demo: install serving-venv
	@echo "make demo: online CTR training: the topic's past from its Parquet export, then the live Kafka topic (an"
	@echo "           embedded tansu broker), one worker SIGKILLed midway, every checkpoint served by KServe, then the"
	@echo "           report: every record applied exactly once, the seam, the served model's AUC and freshness"
	@echo "           (examples/streaming_ctr/demo.py)"
	@$(BIN)/python -m examples.streaming_ctr.demo $(DEMO_ARGS)

# The batch backfill of parquet files into a ledger (the first demo).
demo-backfill: install
	$(BIN)/python examples/backfill/demo.py

lint: install
	$(BIN)/ruff check streamrover tests benchmarks examples
	$(BIN)/mypy
	$(BIN)/lint-imports --no-logo
	PYTHON=$(BIN)/python scripts/gen-proto.sh --check
	# --strict: a broken link fails (not with --quiet, which hides the warnings strict mode counts)
	site=$$(mktemp -d) && trap 'rm -rf "$$site"' EXIT && NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict -d "$$site"

# The user guide (docs/guide/, mkdocs.yml) at http://127.0.0.1:8000
docs: install
	$(BIN)/mkdocs serve

jars:
	bash scripts/fetch-jars.sh

# The dashboard's browser tests drive Debian's chromium through its chromedriver (selenium, a dev extra).
# Idempotent: nothing is fetched once both are installed.
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
browser:
	@if ! command -v chromium >/dev/null || ! command -v chromedriver >/dev/null; then \
	  $(SUDO) apt-get update -q && DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -q chromium chromium-driver; \
	fi

# The Java Flink sink (java/flink-sink/, built with Maven) and the PyFlink venv its jobs run in, both cached
# under ~/.cache/streamrover (PyFlink gets its own venv: apache-flink 2.3 would downgrade numpy, pyarrow, grpcio).
flink-sink:
	PYTHON=$(PYTHON) bash scripts/build-flink-sink.sh

# The model server's venv (streamrover/serving/server.py: KServe + onnxruntime), cached under ~/.cache/streamrover:
# kserve 0.21 needs protobuf>=6, the project venv pins <6.
serving-venv:
	PYTHON=$(PYTHON) bash scripts/build-serving-venv.sh

# DLRover's flash checkpoint, the peer of `python -m benchmarks ckpt` (torch from $(VENV) through a .pth), cached
# under ~/.cache/streamrover.
dlrover-venv: install
	BASE_VENV=$(VENV) bash scripts/build-dlrover-venv.sh

# The k8s tests' control plane (etcd, kube-apiserver, scheduler, controller-manager, kwok) is built from Go
# modules into ~/.cache/streamrover/k8s: ~17 min cold on 2 cores, seconds when cached. `test` starts that
# build first, in the background, so it overlaps the network-bound set-up (pip, Maven) and the first tests;
# the k8s fixture waits for it (tests/operator/k8s/cluster.py) and fails naming the build log if it failed.
k8s-build-start:
	bash scripts/build-k8s.sh --background

# The S3 tests' object store (SeaweedFS's `weed`, tests/s3/) is built the same way into ~/.cache/streamrover/seaweedfs,
# started beside the k8s build (both niced); the S3 fixture waits for it and fails naming the build log if it failed.
seaweedfs-build-start:
	bash scripts/build-seaweedfs.sh --background

seaweedfs:
	bash scripts/build-seaweedfs.sh --wait

k8s:
	bash scripts/build-k8s.sh --wait

# Everything the suite needs, set up side by side: the steps are mostly downloads (pip, Maven, apt) and
# independent of each other (the Flink sink has its own venv and Maven repository), so on a fresh machine
# the set-up takes as long as its slowest step instead of their sum. The k8s build runs in the background.
setup: k8s-build-start seaweedfs-build-start
	$(MAKE) --no-print-directory -j4 --output-sync=target install jars browser flink-sink serving-venv

test: setup lint
	$(BIN)/python -m pytest -q -p no:cacheprovider --durations=20 $(PYTEST_ARGS)

bench: $(BENCH_STAMP) jars flink-sink serving-venv seaweedfs dlrover-venv
	$(BIN)/python -m benchmarks $(BENCH_ARGS)

proto: install
	PYTHON=$(BIN)/python scripts/gen-proto.sh

image:
	@test -n "$(CONTAINER_TOOL)" || { echo "make image: no docker or podman on this machine (CONTAINER_TOOL=...)"; exit 1; }
	@$(CONTAINER_TOOL) info >/dev/null 2>&1 || { echo "make image: $(CONTAINER_TOOL) cannot reach a container engine here ($(CONTAINER_TOOL) info fails): build on a machine that has one"; exit 1; }
	DOCKER_BUILDKIT=1 $(CONTAINER_TOOL) build -f deploy/docker/Dockerfile -t $(IMAGE) .
	@echo "built $(IMAGE): push it where the cluster pulls from, e.g. docker tag $(IMAGE) REGISTRY/$(IMAGE) && docker push REGISTRY/$(IMAGE);"
	@echo "then STREAMROVER_K8S_IMAGE and the Deployment's image (deploy/k8s-overlays/plain-cluster/kustomization.yaml: images)"

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache .import_linter_cache
