#!/usr/bin/env bash
# Start dockerd in the background if no daemon answers, and wait until it does (60 s).
# For machines without systemd (CI containers). Log: ${DOCKERD_LOG:-/var/tmp/dockerd.log}.
set -euo pipefail
if docker info >/dev/null 2>&1; then exit 0; fi
command -v dockerd >/dev/null || { echo "dockerd is missing: apt-get install docker.io" >&2; exit 1; }
if [ "$(id -u)" != 0 ]; then echo "no docker daemon answers, and starting one needs root" >&2; exit 1; fi
log="${DOCKERD_LOG:-/var/tmp/dockerd.log}"
echo "starting dockerd (log: $log)" >&2
setsid nohup dockerd >"$log" 2>&1 < /dev/null &
echo $! > /var/tmp/dockerd.pid
for _ in $(seq 60); do
    docker info >/dev/null 2>&1 && exit 0
    kill -0 "$(cat /var/tmp/dockerd.pid)" 2>/dev/null || break
    sleep 1
done
echo "dockerd did not come up; the end of $log:" >&2
tail -30 "$log" >&2
exit 1
