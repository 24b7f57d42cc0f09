#!/usr/bin/env bash
# Build the broker's store plugin (airflow_provider_amqstream/broker/java) into
# amqstream-broker.jar beside its source; the embedded broker puts it on its classpath
# (broker/process.py). Compiled against the installed ActiveMQ's jars with Debian's JDK;
# skipped when the jar is newer than its sources. Without the jar the broker runs as ActiveMQ
# ships (docs/decisions/broker-copies.md).
set -euo pipefail
cd "$(dirname "$0")/.."
SRC=airflow_provider_amqstream/broker/java
JAR="$SRC/amqstream-broker.jar"
LIB="${ACTIVEMQ_HOME:-/usr/share/activemq}/lib"
fresh=1
[ -f "$JAR" ] || fresh=0
for f in "$SRC"/src/org/amqstream/broker/*.java; do [ "$f" -nt "$JAR" ] && fresh=0; done
[ "$fresh" = 1 ] && exit 0
if ! command -v javac >/dev/null 2>&1; then
  echo "setup: installing default-jdk-headless with apt-get (javac, for the broker's store plugin)"
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq default-jdk-headless >/dev/null
fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
javac --release 11 -nowarn -d "$tmp" -cp "$LIB/*" "$SRC"/src/org/amqstream/broker/*.java
# Written beside and renamed, so a broker starting meanwhile never reads half a jar.
jar --create --file "$JAR.tmp" -C "$tmp" .
mv "$JAR.tmp" "$JAR"
echo "setup: built $JAR"
