#!/usr/bin/env bash
# Build, once per machine, the Kubernetes control plane that the k8s test fixture starts
# (tests/operator/k8s/): etcd, kube-apiserver, kube-scheduler, kube-controller-manager and kwok (fake
# nodes), and kubectl (the Kubernetes guide page's commands run with it), all from the Go module proxy with
# `go build` (no Docker, no other download).
#
#   scripts/build-k8s.sh              # build (or reuse) into the cache; exit status = build status
#   scripts/build-k8s.sh --background # start the build detached and return at once (make's set-up
#                                     # does this so the ~17 min cold build overlaps pip and Maven)
#   scripts/build-k8s.sh --wait       # wait for a build started by --background (or build now if none
#                                     # ran); exits non-zero with the log's tail if the build failed
#   scripts/build-k8s.sh --bin-dir    # print where the binaries are (or will be)
#
# Everything lives in ${STREAMROVER_CACHE:-$HOME/.cache/streamrover}/k8s: bin-<versions>/ (binaries,
# kwok stages, a .complete marker), gomod/ and gocache/ (the Go module and build caches, so a rebuild
# after the binaries are gone takes seconds), build.log, and build.status (the exit status of the
# last build, written when it ends; absent while one runs). A complete bin dir is reused as is; one made
# before kubectl was added gets kubectl built into it (~20 s with the build cache warm).
# Needs Go >= 1.24 on PATH (or in /usr/local/go/bin). Cold on 2 cores: ~17 min, peak RSS ~1.8 GB.
set -euo pipefail

KV=v1.34.4            # k8s.io/kubernetes; its staging modules are v0.<minor>.<patch>
ETCD_V=v3.6.4
KWOK_V=v0.8.0
SV=v0.${KV#v1.}
base="${STREAMROVER_CACHE:-$HOME/.cache/streamrover}/k8s"
bin="$base/bin-k8s$KV-etcd$ETCD_V-kwok$KWOK_V"
log="$base/build.log"
status="$base/build.status"
mkdir -p "$base"
complete() { [ -f "$bin/.complete" ] && [ -x "$bin/kubectl" ]; }

case "${1:-}" in
  --background)
    if complete; then echo "build-k8s: binaries already in $bin"; exit 0; fi
    exec 9>"$base/.lock"
    if ! flock -n 9; then echo "build-k8s: a build is already running (log: $log)"; exit 0; fi
    exec 9>&-
    rm -f "$status"
    echo "build-k8s: building in the background (log: $log)"
    nohup setsid nice -n 10 "$0" >"$log" 2>&1 </dev/null &
    exit 0 ;;
  --wait)
    if complete; then exit 0; fi
    exec 9>"$base/.lock"
    flock 9   # held by a running build: returns when it ends
    if complete; then exit 0; fi
    if [ ! -f "$status" ]; then   # no build has run (no --background): build now, in the foreground
      flock -u 9; exec "$0"
    fi
    echo "build-k8s: the build failed (status $(cat "$status" 2>/dev/null || echo none)); tail of $log:" >&2
    tail -n 30 "$log" >&2 || true
    exit 1 ;;
  --bin-dir) echo "$bin"; exit 0 ;;
  "") ;;
  *) echo "usage: $0 [--background|--wait|--bin-dir]" >&2; exit 2 ;;
esac

# A command that downloads modules, tried 3 times: a dropped connection fails it (what was fetched stays in GOMODCACHE
# and what was compiled in GOCACHE, so a try again costs little).
again() {
  local try
  for try in 1 2 3; do
    "$@" && return 0
    [ "$try" = 3 ] && return 1
    echo "build-k8s: '$*' failed (try $try of 3); again in $((try * 20)) s" >&2
    sleep $((try * 20))
  done
}

# k8s.io/kubernetes requires its staging modules at v0.0.0 + replace => ./staging: map them to $SV. Sets $ld.
kube_module() {
  mkdir -p "$base/src/kube" && cd "$base/src/kube"
  again go mod download k8s.io/kubernetes@"$KV"
  mod="$GOMODCACHE/cache/download/k8s.io/kubernetes/@v/$KV.mod"
  { printf 'module streamrover.local/kube\n\ngo 1.24.0\n\ngodebug default=go1.24\n\nrequire k8s.io/kubernetes %s\n\nreplace (\n' "$KV"
    grep -E '^\s+k8s.io/\S+ v0.0.0$' "$mod" | awk -v sv="$SV" '{print "\t"$1" => "$1" "sv}'
    echo ")"; } >go.mod
  minor=${KV#v1.}; minor=${minor%%.*}
  ld="-s -w -X k8s.io/component-base/version.gitVersion=$KV -X k8s.io/component-base/version.gitMajor=1"
  ld="$ld -X k8s.io/component-base/version.gitMinor=$minor -X k8s.io/component-base/version.gitTreeState=clean"
}

build() {
  exec 9>"$base/.lock"
  flock 9   # one build at a time per cache
  if complete; then echo "build-k8s: binaries already in $bin"; echo 0 >"$status"; exit 0; fi
  rm -f "$status"
  trap 'rc=$?; echo "$rc" >"$status"; [ "$rc" = 0 ] || echo "build-k8s: FAILED with status $rc" >&2' EXIT

  PATH="$PATH:/usr/local/go/bin"
  command -v go >/dev/null || { echo "build-k8s: Go is not on PATH (needs Go >= 1.24)" >&2; exit 2; }
  export GOPATH="$base/gopath" GOMODCACHE="$base/gomod" GOCACHE="$base/gocache" GOFLAGS=-mod=mod GOTOOLCHAIN=local
  t_all=$(date +%s)
  timed() { local t0; t0=$(date +%s); again "$@"; echo "build-k8s: ${*: -1} built in $(( $(date +%s) - t0 )) s"; }
  if [ -f "$bin/.complete" ]; then  # a bin dir from before kubectl was added: add kubectl only
    kube_module
    timed go build -trimpath -ldflags "$ld" -o "$bin/kubectl.tmp" k8s.io/kubernetes/cmd/kubectl
    mv "$bin/kubectl.tmp" "$bin/kubectl"
    echo "build-k8s: kubectl added to $bin in $(( $(date +%s) - t_all )) s"
    return 0
  fi
  tmp="$bin.tmp"
  rm -rf "$tmp" && mkdir -p "$tmp"

  # etcd: server/v3 has relative replace directives, so `go install ...@ver` is refused; wrap it.
  mkdir -p "$base/src/etcd" && cd "$base/src/etcd"
  printf 'module streamrover.local/etcd\n\ngo 1.23.0\n\nrequire go.etcd.io/etcd/server/v3 %s\n' "$ETCD_V" >go.mod
  timed go build -trimpath -ldflags "-s -w" -o "$tmp/etcd" go.etcd.io/etcd/server/v3

  kube_module
  for c in kube-apiserver kube-scheduler kube-controller-manager kubectl; do
    timed go build -trimpath -ldflags "$ld" -o "$tmp/$c" "k8s.io/kubernetes/cmd/$c"
  done

  # kwok: no replace directives; build from its module with a wrapper too (keeps one GOPATH-free layout).
  mkdir -p "$base/src/kwok" && cd "$base/src/kwok"
  printf 'module streamrover.local/kwok\n\ngo 1.24.0\n\nrequire sigs.k8s.io/kwok %s\n' "$KWOK_V" >go.mod
  timed go build -trimpath -ldflags "-s -w" -o "$tmp/kwok" sigs.k8s.io/kwok/cmd/kwok
  stages="$GOMODCACHE/sigs.k8s.io/kwok@$KWOK_V/kustomize/stage"
  for f in node/fast/node-initialize node/heartbeat/node-heartbeat pod/fast/pod-ready pod/fast/pod-complete pod/fast/pod-delete; do
    echo '---'; cat "$stages/$f.yaml"; done >"$tmp/kwok-stages.yaml"

  touch "$tmp/.complete"
  rm -rf "$bin" && mv "$tmp" "$bin"
  echo "build-k8s: all built in $(( $(date +%s) - t_all )) s into $bin"
}

build  # all in a function: bash has parsed it whole before it runs, so editing this file mid-build is safe
exit
