#!/usr/bin/env bash
# Set up, once, the virtualenv DLRover's flash checkpoint runs in for `python -m benchmarks ckpt`'s peer rows
# (benchmarks/bench_ckpt/dlrover_peer.py). Prints the venv's python on its last line.
#
# Its own venv, <cache>/dlrover-venv (cache: ${STREAMROVER_CACHE:-$HOME/.cache/streamrover}), holding dlrover and
# its two small dependencies the project venv lacks; torch (and psutil, requests, packaging) come from the project
# venv through a .pth file, so the peer runs the same torch as our side and nothing large is downloaded twice.
set -euo pipefail

cache="${STREAMROVER_CACHE:-$HOME/.cache/streamrover}"
python=${PYTHON:-python3}
base=${BASE_VENV:-.venv}
pins=(dlrover==0.6.1 pynvml==13.0.1 deprecated==1.3.1)
stamp=".complete-$(echo "${pins[*]} $(cd "$base" && pwd)" | sha256sum | cut -c1-16)"
venv="$cache/dlrover-venv"

mkdir -p "$cache"
exec 9>"$cache/.dlrover-venv.lock"
flock 9  # one build at a time per cache

if [ ! -f "$venv/$stamp" ]; then
  echo "build-dlrover-venv: installing ${pins[*]} into $venv (torch from $base)" >&2
  rm -rf "$venv"
  "$base/bin/python" -m venv "$venv"
  site=$("$base/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  own=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  echo "$site" > "$own/streamrover-base.pth"
  for try in 1 2 3; do
    "$venv/bin/pip" install --disable-pip-version-check --progress-bar off -q --retries 10 --only-binary=:all: \
      "${pins[@]}" >&2 && break
    if [ "$try" = 3 ]; then echo "build-dlrover-venv: pip failed 3 times" >&2; exit 1; fi
    echo "build-dlrover-venv: pip failed (try $try of 3); again in $((try * 20)) s" >&2
    sleep $((try * 20))
  done
  "$venv/bin/python" -c "from dlrover.trainer.torch.flash_checkpoint.ddp import DdpCheckpointer" >&2
  touch "$venv/$stamp"
fi
echo "$venv/bin/python"
