#!/usr/bin/env bash
# Benchmarks (not tests): amqstream against raw stomp.py, SFTP and the disk, 100 MiB to 4 GiB.
# Needs the OpenSSH server and rsync for the SFTP/rsync baselines (installed here if missing) and about
# three times the largest file size free in the scratch directory. Writes docs/benchmarks.md.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh
need=()
[ -x /usr/sbin/sshd ] || need+=(openssh-server)
command -v rsync >/dev/null 2>&1 || need+=(rsync)  # the many-file baseline
if [ ${#need[@]} -gt 0 ]; then
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need[@]}" >/dev/null
fi
python -m benchmarks "$@"
