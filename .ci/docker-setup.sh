#!/usr/bin/env bash
# Prepare this machine for the docker-compose end-to-end tests (tests/e2e, marker `compose`):
# install docker.io, docker-compose and debootstrap when missing, start dockerd when none runs,
# and build the local images (etcd, the agent, moto for the s3 profile, Prometheus from Debian's
# package for the monitoring profile; cached by content hash: a second run takes seconds), and
# generate the compose secrets into docker/secrets/ (docker/gen-secrets.sh: etcd TLS and
# passwords, the per-job secret, S3 keys; only the missing ones; the e2e tests make their own).
# Idempotent. Fails loudly: the e2e tests must not be skipped silently in CI.
set -euo pipefail
cd "$(dirname "$0")/.."
started=$(date +%s)
need=()
command -v docker >/dev/null || need+=(docker.io)
command -v dockerd >/dev/null || need+=(docker.io)
command -v docker-compose >/dev/null || need+=(docker-compose)
command -v debootstrap >/dev/null || need+=(debootstrap)
command -v openssl >/dev/null || need+=(openssl)
if [ ${#need[@]} -gt 0 ]; then
    echo "== docker-setup: apt-get install ${need[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y "${need[@]}" >/dev/null 2>&1 || {
        apt-get update >/dev/null && apt-get install -y "${need[@]}" >/dev/null
    }
fi
bash docker/start-dockerd.sh
echo "== docker-setup: images"
bash docker/build-base.sh
echo "== docker-setup: secrets"
bash docker/gen-secrets.sh
echo "== docker-setup: done in $(( $(date +%s) - started ))s"
