# syntax=docker/dockerfile:1
# One image per node: elastic-agent (torchrun with the etcd-v3 rendezvous) + the CNN worker.
#
# CPU (default):
#   docker build -t elastic-agent .
# CUDA (NCCL comes with PyTorch's CUDA wheels; run with --gpus all / compose `gpus: all`):
#   docker build -t elastic-agent:cuda \
#     --build-arg BASE_IMAGE=nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04 \
#     --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 .
# Offline / air-gapped: put wheels in docker/wheelhouse/ and add --build-arg PIP_ARGS=--no-index
# (docker/build-base.sh does this with the wheels pip already has on the machine).
#
# BASE_IMAGE needs python3 (>=3.10) with venv, or apt-get to install it (Debian/Ubuntu).
ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE}

ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG PIP_ARGS=""
ENV LANG=C.UTF-8 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH

# Python with venv: present in python:* images and in docker/build-base.sh's base; installed
# from the distribution on others (nvidia/cuda, plain debian/ubuntu).
RUN if ! python3 -c 'import venv, ensurepip' 2>/dev/null; then \
        apt-get update && \
        DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
            python3 python3-venv ca-certificates && \
        rm -rf /var/lib/apt/lists/*; \
    fi && python3 -m venv /opt/venv

WORKDIR /app
# Dependencies first, in layers that change only when the wheels or the dependency list do:
# torch (+ docker/wheelhouse/requirements.txt when a wheelhouse brings one), then whatever else
# pyproject.toml lists, with the `plot` extra for the dashboard's timeline picture (already
# satisfied in the offline build; from PyPI otherwise).
COPY docker/wheelhouse/ /tmp/wheels/
RUN set -eux; \
    pip install $PIP_ARGS --find-links /tmp/wheels --upgrade pip 'setuptools>=77' wheel; \
    pip install $PIP_ARGS --find-links /tmp/wheels --extra-index-url "$TORCH_INDEX_URL" torch torchvision; \
    if [ -f /tmp/wheels/requirements.txt ]; then \
        pip install $PIP_ARGS --find-links /tmp/wheels -r /tmp/wheels/requirements.txt; \
    fi
COPY pyproject.toml /tmp/pyproject.toml
RUN set -eux; \
    python -c 'import tomllib; p = tomllib.load(open("/tmp/pyproject.toml", "rb"))["project"]; print("\n".join(p["dependencies"] + p["optional-dependencies"]["plot"]))' \
        > /tmp/requirements.txt; \
    pip install $PIP_ARGS --find-links /tmp/wheels -r /tmp/requirements.txt 's3fs>=2023.1'; \
    rm -rf /tmp/wheels /root/.cache

# The project itself (configs/ stays in /app, the working directory: --config configs/...).
COPY pyproject.toml README.md /app/
COPY elastic /app/elastic
COPY elastic_tools /app/elastic_tools
COPY configs /app/configs
COPY docker/entrypoint.sh /usr/local/bin/elastic-entrypoint
COPY docker/etcd-init.py /usr/local/bin/elastic-etcd-init
RUN pip install --no-deps --no-build-isolation /app && rm -rf /app/build /app/*.egg-info \
    && chmod 0755 /usr/local/bin/elastic-entrypoint /usr/local/bin/elastic-etcd-init \
    && elastic-agent --help >/dev/null

# The agent runs as an unprivileged user (numeric, so that a runtime can check runAsNonRoot).
# It writes only /checkpoints (a volume: a new named volume takes this directory's owner),
# /dev/shm (per-step snapshots of the model: give the container shm_size), /tmp and its home.
# Secret files it reads (docker/gen-secrets.sh) must belong to this uid: AGENT_UID.
ARG AGENT_UID=10001
RUN set -eux; \
    groupadd --system --gid "$AGENT_UID" elastic; \
    useradd --system --uid "$AGENT_UID" --gid "$AGENT_UID" --home-dir /home/elastic \
        --create-home --shell /usr/sbin/nologin elastic; \
    install -d -o "$AGENT_UID" -g "$AGENT_UID" -m 0750 /checkpoints
ENV HOME=/home/elastic
USER ${AGENT_UID}:${AGENT_UID}

# One node's agent; the arguments are elastic-agent's (torchrun's) options and the worker.
# The entrypoint adds --local-addr=<this container's IP> and execs elastic-agent as PID 1, so
# `docker stop` (SIGTERM) reaches it: the workers checkpoint and the node leaves the rendezvous.
# Any other first argument runs that command instead (e.g. `elastic status ...`).
ENTRYPOINT ["elastic-entrypoint"]
CMD ["--help"]
