#!/usr/bin/env bash
# Set up, once, the virtualenv the model server runs in (streamrover/serving/server.py): KServe's ModelServer
# with onnxruntime. Prints the venv's python on its last line.
#
# Its own venv, <cache>/serving-venv (cache: ${STREAMROVER_CACHE:-$HOME/.cache/streamrover}): kserve 0.21.0
# requires protobuf>=6.33.5, against the project venv's protobuf<6 pin (tensorflow-cpu 2.20, apache-flink 2.3).
# The server imports only numpy, onnxruntime, kserve and streamrover's numpy-only serving modules (put on
# sys.path by the server itself), never torch.
set -euo pipefail

cache="${STREAMROVER_CACHE:-$HOME/.cache/streamrover}"
python=${PYTHON:-python3}
pins=(kserve==0.21.0 onnxruntime==1.31.1 numpy==2.4.6)  # onnxruntime as in pyproject.toml's `serving` extra
stamp=".complete-$(echo "${pins[*]}" | sha256sum | cut -c1-16)"
venv="$cache/serving-venv"

mkdir -p "$cache"
exec 9>"$cache/.serving-venv.lock"
flock 9  # one build at a time per cache

if [ ! -f "$venv/$stamp" ]; then
  echo "build-serving-venv: installing ${pins[*]} into $venv" >&2
  rm -rf "$venv"
  "$python" -m venv "$venv"
  # Tried again when a download drops (CI's machines have lost large wheels mid-download); pip's cache keeps the rest.
  for try in 1 2 3; do
    "$venv/bin/pip" install --disable-pip-version-check --progress-bar off -q --retries 10 \
      --only-binary=kserve,onnxruntime,numpy,grpcio,protobuf,pydantic-core,orjson,uvloop,httptools "${pins[@]}" >&2 && break
    if [ "$try" = 3 ]; then echo "build-serving-venv: pip failed 3 times" >&2; exit 1; fi
    echo "build-serving-venv: pip failed (try $try of 3); again in $((try * 20)) s" >&2
    sleep $((try * 20))
  done
  touch "$venv/$stamp"
fi
echo "$venv/bin/python"
