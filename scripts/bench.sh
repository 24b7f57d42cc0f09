#!/usr/bin/env bash
# Benchmarks (not tests): amqstream against raw stomp.py, SFTP and the disk, 100 MiB to 4 GiB.
# Needs the OpenSSH server for the SFTP baselines (installed here if missing) and about
# three times the largest file size free in the scratch directory. Writes docs/benchmarks.md.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh
if [ ! -x /usr/sbin/sshd ]; then
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq openssh-server >/dev/null
fi
python -m benchmarks "$@"
