#!/usr/bin/env bash
# Build, once per source version, the Java Flink sink (java/flink-sink/: streamrover.sinks.flink) and set up
# the PyFlink virtualenv its jobs run in. Prints the jar's path on its last line.
#
#   scripts/build-flink-sink.sh           # the jar and the venv
#   scripts/build-flink-sink.sh jar       # the jar only
#
# The jar lands in ${STREAMROVER_CACHE:-$HOME/.cache/streamrover}/flink-sink/<hash>.jar (the hash is of the
# pom, the Java sources and the .proto), copied to streamrover-flink-sink.jar beside it (what
# streamrover.sinks.flink loads by default); Maven's repository is <cache>/m2. A cached hash costs nothing.
#
# PyFlink lives in its own venv, <cache>/flink-venv: apache-flink 2.3.0 pins apache-beam <= 2.61, which
# would downgrade the project venv's numpy (2.4 -> 2.1), pyarrow (26 -> 16) and grpcio (1.85 -> 1.65).
# Needs Java 17+ and Maven on PATH.
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cache="${STREAMROVER_CACHE:-$HOME/.cache/streamrover}"
python=${PYTHON:-python3}
flink_pin="apache-flink==2.3.0"  # pyproject.toml's `flink` extra
what=${1:-all}

mkdir -p "$cache/flink-sink"
exec 9>"$cache/flink-sink/.lock"
flock 9  # one build at a time per cache

if [ "$what" = all ]; then
  venv="$cache/flink-venv"
  if [ ! -f "$venv/.complete-$flink_pin" ]; then
    echo "build-flink-sink: installing $flink_pin into $venv" >&2
    rm -rf "$venv"
    "$python" -m venv "$venv"
    "$venv/bin/pip" install --disable-pip-version-check --progress-bar off -q \
      --only-binary=apache-flink,apache-beam,pemja,numpy,pyarrow,grpcio,pandas,protobuf "$flink_pin" >&2
    touch "$venv/.complete-$flink_pin"
  fi
fi

command -v mvn >/dev/null || { echo "build-flink-sink: Maven (mvn) is not on PATH: apt-get install maven" >&2; exit 2; }
src="$root/java/flink-sink"
hash=$(cd "$root" && { echo java/flink-sink/pom.xml; find java/flink-sink/src -type f | sort; \
  echo streamrover/shard_service/v1/shard_service.proto; } | xargs sha256sum | sha256sum | cut -c1-16)
jar="$cache/flink-sink/$hash.jar"
if [ ! -f "$jar" ]; then
  echo "build-flink-sink: building the sink ($hash)" >&2
  build=$(mktemp -d)
  trap 'rm -rf "$build"' EXIT
  for try in 1 2 3; do  # a dropped download is tried again (what Maven got stays in $cache/m2)
    mvn -B -q -Dstyle.color=never -Dmaven.repo.local="$cache/m2" -f "$src/pom.xml" \
      -DbuildDirectory="$build" package -DskipTests >&2 && break
    if [ "$try" = 3 ]; then echo "build-flink-sink: Maven failed 3 times" >&2; exit 1; fi
    echo "build-flink-sink: Maven failed (try $try of 3); again in $((try * 20)) s" >&2
    sleep $((try * 20))
  done
  cp "$build/streamrover-flink-sink-0.1.0.jar" "$jar.tmp"
  mv "$jar.tmp" "$jar"
fi
if ! cmp -s "$jar" "$cache/flink-sink/streamrover-flink-sink.jar"; then
  cp "$jar" "$cache/flink-sink/.current.tmp"
  mv "$cache/flink-sink/.current.tmp" "$cache/flink-sink/streamrover-flink-sink.jar"
fi
echo "$jar"
