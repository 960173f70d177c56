#!/usr/bin/env bash
# Fetch, once per machine, the Maven Central jars of the brokers that the test fixtures start
# (tests/brokers/): Apache Kafka (KRaft), Apache RocketMQ (name server, broker, proxy, tools) and Apache
# Pulsar standalone (broker with an in-process bookie), Flink's Kafka connector (flink-kafka) for the PyFlink jobs and Spark's (spark: spark-sql-kafka-0-10).
#
#   scripts/fetch-jars.sh             # all brokers
#   scripts/fetch-jars.sh kafka       # only the named ones (kafka, rocketmq, pulsar, flink-kafka, spark)
#
# Jars land in ${STREAMROVER_CACHE:-$HOME/.cache/streamrover}/jars/<broker>-<version>/, the version
# being the one pinned in tests/brokers/jars/<broker>/pom.xml. A directory holding a .complete marker
# is reused as is, so running this again costs nothing. Needs Java 17+ and Maven on PATH.
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cache="${STREAMROVER_CACHE:-$HOME/.cache/streamrover}/jars"
if [ "$#" -gt 0 ]; then brokers=("$@"); else brokers=(kafka rocketmq pulsar flink-kafka spark); fi

command -v mvn >/dev/null || { echo "fetch-jars: Maven (mvn) is not on PATH: apt-get install maven" >&2; exit 2; }
mkdir -p "$cache"
exec 9>"$cache/.lock"
flock 9  # one fetch at a time per cache (parallel test runs, make -j)

for broker in "${brokers[@]}"; do
  pom="$root/tests/brokers/jars/$broker/pom.xml"
  if [ ! -f "$pom" ]; then
    echo "fetch-jars: unknown broker '$broker' (no $pom); known: kafka rocketmq pulsar flink-kafka spark" >&2
    exit 2
  fi
  version=$(sed -n "s:.*<$broker.version>\(.*\)</$broker.version>.*:\1:p" "$pom" | head -n 1)
  if [ -z "$version" ]; then
    echo "fetch-jars: $pom has no <$broker.version> property" >&2
    exit 2
  fi
  dest="$cache/$broker-$version"
  if [ -f "$dest/.complete" ]; then
    echo "fetch-jars: $broker $version already in $dest"
    continue
  fi
  tmp=$(mktemp -d "$cache/.$broker-$version.XXXXXX")
  trap 'rm -rf "$tmp"' EXIT
  echo "fetch-jars: fetching $broker $version into $dest"
  # A dropped connection is tried again (what Maven got stays in ~/.m2): CI's machines have lost large downloads.
  for try in 1 2 3; do
    mvn -B -q -Dstyle.color=never -f "$pom" dependency:copy-dependencies -DincludeScope=runtime \
      -DoutputDirectory="$tmp" && break
    if [ "$try" = 3 ]; then echo "fetch-jars: Maven failed 3 times for $broker $version" >&2; exit 1; fi
    echo "fetch-jars: Maven failed for $broker $version (try $try of 3); again in $((try * 20)) s" >&2
    sleep $((try * 20))
  done
  count=$(find "$tmp" -name '*.jar' | wc -l)
  if [ "$count" -eq 0 ]; then
    echo "fetch-jars: Maven copied no jar for $broker $version" >&2
    exit 1
  fi
  touch "$tmp/.complete"
  rm -rf "$dest"
  mv "$tmp" "$dest"
  trap - EXIT
  echo "fetch-jars: $broker $version: $count jars in $dest"
done
