#!/usr/bin/env bash
# Build, once per machine, the S3-compatible object store that the S3 tests start (tests/s3/): SeaweedFS's
# `weed` binary (Apache-2.0), from the Go module proxy with `go build` (no Docker, no other download).
#
#   scripts/build-seaweedfs.sh              # build (or reuse) into the cache; exit status = build status
#   scripts/build-seaweedfs.sh --background # start the build detached and return at once (make's set-up does
#                                           # this so the cold build overlaps pip, Maven and the k8s build)
#   scripts/build-seaweedfs.sh --wait       # wait for a build started by --background (or build now if none
#                                           # ran); exits non-zero with the log's tail if the build failed
#   scripts/build-seaweedfs.sh --bin-dir    # print where the binary is (or will be)
#
# Everything lives in ${STREAMROVER_CACHE:-$HOME/.cache/streamrover}/seaweedfs: bin-<version>/ (the weed
# binary and a .complete marker), gomod/ and gocache/ (the Go module and build caches), build.log, and
# build.status (the exit status of the last build, written when it ends; absent while one runs).
# Needs Go >= 1.26.6 on PATH (or in /usr/local/go/bin): SeaweedFS's go.mod asks for it. Cold, niced, on a 2-core
# machine at load ~15 (other builds and tests): 24 min wall, 7 CPU-min (364 s user, 58 s sys), peak RSS 2.2 GB;
# the caches take 4 GB (gomod 2.2 GB, gocache 1.8 GB), the binary 164 MB.
set -euo pipefail

SW_V=v0.0.0-20261109003541-7506e5f91cd6   # github.com/seaweedfs/seaweedfs (it tags no Go-module releases)
base="${STREAMROVER_CACHE:-$HOME/.cache/streamrover}/seaweedfs"
bin="$base/bin-${SW_V##*-}"
log="$base/build.log"
status="$base/build.status"
mkdir -p "$base"

case "${1:-}" in
  --background)
    if [ -f "$bin/.complete" ]; then echo "build-seaweedfs: binary already in $bin"; exit 0; fi
    exec 9>"$base/.lock"
    if ! flock -n 9; then echo "build-seaweedfs: a build is already running (log: $log)"; exit 0; fi
    exec 9>&-
    rm -f "$status"
    echo "build-seaweedfs: building in the background (log: $log)"
    nohup setsid nice -n 10 "$0" >"$log" 2>&1 </dev/null &
    exit 0 ;;
  --wait)
    if [ -f "$bin/.complete" ]; then exit 0; fi
    exec 9>"$base/.lock"
    flock 9   # held by a running build: returns when it ends
    if [ -f "$bin/.complete" ]; then exit 0; fi
    if [ ! -f "$status" ]; then   # no build has run (no --background): build now, in the foreground
      flock -u 9; exec "$0"
    fi
    echo "build-seaweedfs: the build failed (status $(cat "$status" 2>/dev/null || echo none)); tail of $log:" >&2
    tail -n 30 "$log" >&2 || true
    exit 1 ;;
  --bin-dir) echo "$bin"; exit 0 ;;
  "") ;;
  *) echo "usage: $0 [--background|--wait|--bin-dir]" >&2; exit 2 ;;
esac

build() {
  exec 9>"$base/.lock"
  flock 9   # one build at a time per cache
  if [ -f "$bin/.complete" ]; then echo "build-seaweedfs: binary already in $bin"; echo 0 >"$status"; exit 0; fi
  rm -f "$status"
  trap 'rc=$?; echo "$rc" >"$status"; [ "$rc" = 0 ] || echo "build-seaweedfs: FAILED with status $rc" >&2' EXIT

  PATH="$PATH:/usr/local/go/bin"
  command -v go >/dev/null || { echo "build-seaweedfs: Go is not on PATH (needs Go >= 1.26.6)" >&2; exit 2; }
  export GOPATH="$base/gopath" GOMODCACHE="$base/gomod" GOCACHE="$base/gocache" GOFLAGS=-mod=mod GOTOOLCHAIN=local
  tmp="$bin.tmp"
  rm -rf "$tmp" && mkdir -p "$tmp"
  t0=$(date +%s)
  # A wrapper module: a dependency's replace directives are ignored, so SeaweedFS's one (go-bip39, deleted from
  # GitHub, reached through rclone) is restated here. No build tags: the optional filer stores stay out.
  mkdir -p "$base/src" && cd "$base/src"
  printf 'module streamrover.local/seaweedfs\n\ngo 1.26.6\n\nrequire github.com/seaweedfs/seaweedfs %s\n\nreplace github.com/tyler-smith/go-bip39 => github.com/cosmos/go-bip39 v1.0.0\n' "$SW_V" >go.mod
  # Tried 3 times: a dropped download fails it (fetched modules stay in GOMODCACHE, compiled packages in GOCACHE).
  for try in 1 2 3; do
    go build -trimpath -ldflags "-s -w" -o "$tmp/weed" github.com/seaweedfs/seaweedfs/weed && break
    [ "$try" = 3 ] && exit 1
    echo "build-seaweedfs: go build failed (try $try of 3); again in $((try * 20)) s" >&2
    sleep $((try * 20))
  done
  touch "$tmp/.complete"
  rm -rf "$bin" && mv "$tmp" "$bin"
  echo "build-seaweedfs: weed built in $(( $(date +%s) - t0 )) s into $bin"
}

build  # all in a function: bash has parsed it whole before it runs, so editing this file mid-build is safe
exit
