#!/usr/bin/env bash
# Generate the secrets docker-compose.yml mounts (compose `secrets:`), once per job:
#
#   sudo docker/gen-secrets.sh [DIR]     # DIR: $ELASTIC_SECRETS_DIR, default docker/secrets
#
# DIR/ (0700, owned by whoever ran it, or $SUDO_UID under sudo; files 0600, certificates 0644):
#   job-secret          the per-job secret: signs the rendezvous state in etcd and the
#                       checkpoint commit markers ($ELASTIC_SECRET_FILE in every agent)
#   etcd-root-password  etcd's root user (only the one-shot etcd-init service gets it)
#   etcd-password       the agents' etcd user ($ELASTIC_ETCD_USER, default elastic): read and
#                       write under the key prefix /elastic/ only
#   ca.crt ca.key       a private CA for etcd's TLS (ca.key is used here only, never mounted)
#   etcd.crt etcd.key   etcd's server certificate: DNS etcd, localhost, IP 127.0.0.1
#   client.crt client.key  the client certificate (CN elastic-client, not an etcd user: the
#                       certificate alone logs nobody in; the password does)
#   s3-access-key s3-secret-key  the s3 profile's server credentials (MinIO's root user)
#   s3-credentials      the same as an AWS shared-credentials file, for the agents' s3fs
# DIR/agent/ holds copies of what the agent image's user (uid $ELASTIC_AGENT_UID, default
# 10001) reads, owned by that uid, mode 0400: compose bind-mounts secret files with their
# owner and mode, so the non-root agent needs its own copy.
#
# Idempotent: only missing files are generated; the agent copies are refreshed. To rotate a
# secret, delete its file and run this again (then `docker compose up -d` recreates the
# containers). Keep job-secret for as long as the checkpoints matter: the agents refuse a
# checkpoint whose marker another secret signed. etcd keeps the passwords it was set up with
# in its volume; etcd-init changes them to the files' on the next `up`.
#
# Needs openssl, and root (or $ELASTIC_AGENT_UID as the caller) to hand the copies to the
# agent's uid. Secrets never appear on a command line: openssl writes them into the files.
set -euo pipefail
umask 077

REPO="$(cd "$(dirname "$0")/.." && pwd)"
DIR="${1:-${ELASTIC_SECRETS_DIR:-$REPO/docker/secrets}}"
AGENT_UID="${ELASTIC_AGENT_UID:-10001}"
AGENT_GID="${ELASTIC_AGENT_GID:-$AGENT_UID}"
OWNER_UID="${SUDO_UID:-$(id -u)}"
OWNER_GID="${SUDO_GID:-$(id -g)}"
DAYS="${ELASTIC_TLS_DAYS:-825}"

command -v openssl >/dev/null || { echo "gen-secrets.sh needs openssl (apt-get install openssl)" >&2; exit 1; }
if [ "$(id -u)" != 0 ] && [ "$(id -u)" != "$AGENT_UID" ]; then
    echo "gen-secrets.sh: the agent's copies must belong to uid $AGENT_UID; run it as root" \
         "(sudo $0 ${1:-})" >&2
    exit 1
fi
mkdir -p "$DIR/agent"
chmod 0700 "$DIR"
log() { echo "[gen-secrets] $*" >&2; }

# new FILE COMMAND...: run COMMAND with its output into FILE, unless FILE exists (atomic).
new() {
    local file="$DIR/$1"; shift
    [ -s "$file" ] && return 0
    "$@" > "$file.tmp"
    mv "$file.tmp" "$file"
    log "generated $file"
}
new job-secret openssl rand -hex 32
new etcd-root-password openssl rand -hex 24
new etcd-password openssl rand -hex 24
new s3-access-key sh -c 'printf "elastic%s\n" "$(openssl rand -hex 8)"'
new s3-secret-key openssl rand -hex 24
if [ ! -s "$DIR/s3-credentials" ] || [ "$DIR/s3-credentials" -ot "$DIR/s3-access-key" ] \
        || [ "$DIR/s3-credentials" -ot "$DIR/s3-secret-key" ]; then
    { echo "[default]"
      echo "aws_access_key_id = $(cat "$DIR/s3-access-key")"
      echo "aws_secret_access_key = $(cat "$DIR/s3-secret-key")"; } > "$DIR/s3-credentials.tmp"
    mv "$DIR/s3-credentials.tmp" "$DIR/s3-credentials"
    log "generated $DIR/s3-credentials"
fi

# --- TLS: a private CA, etcd's server certificate, one client certificate (EC P-256) ---------
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
key() { openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256 -out "$1" 2>/dev/null; }
# sign NAME SUBJECT EXTENSIONS: NAME.key + NAME.crt signed by the CA
sign() {
    local name="$1" subject="$2" ext="$3"
    key "$tmp/$name.key"
    openssl req -new -key "$tmp/$name.key" -subj "$subject" -out "$tmp/$name.csr" 2>/dev/null
    printf '%b' "$ext" > "$tmp/$name.ext"
    openssl x509 -req -in "$tmp/$name.csr" -CA "$DIR/ca.crt" -CAkey "$DIR/ca.key" \
        -set_serial "0x$(openssl rand -hex 16)" -days "$DAYS" -extfile "$tmp/$name.ext" \
        -out "$tmp/$name.crt" 2>/dev/null
    mv "$tmp/$name.key" "$DIR/$name.key"
    mv "$tmp/$name.crt" "$DIR/$name.crt"
    log "generated $DIR/$name.crt (+ key)"
}
fresh=0
if [ ! -s "$DIR/ca.crt" ] || [ ! -s "$DIR/ca.key" ]; then
    key "$tmp/ca.key"
    openssl req -x509 -new -key "$tmp/ca.key" -subj "/CN=elastic compose CA" -days 3650 \
        -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign" \
        -out "$tmp/ca.crt" 2>/dev/null
    mv "$tmp/ca.key" "$DIR/ca.key"
    mv "$tmp/ca.crt" "$DIR/ca.crt"
    log "generated $DIR/ca.crt (+ key)"
    fresh=1
fi
if [ "$fresh" = 1 ] || [ ! -s "$DIR/etcd.crt" ] || [ ! -s "$DIR/etcd.key" ]; then
    # clientAuth too: etcd's healthcheck uses it (CN etcd is no etcd user either).
    sign etcd "/CN=etcd" \
        "subjectAltName=DNS:etcd,DNS:localhost,IP:127.0.0.1\nextendedKeyUsage=serverAuth,clientAuth\nkeyUsage=critical,digitalSignature,keyEncipherment\n"
fi
if [ "$fresh" = 1 ] || [ ! -s "$DIR/client.crt" ] || [ ! -s "$DIR/client.key" ]; then
    sign client "/CN=elastic-client" \
        "extendedKeyUsage=clientAuth\nkeyUsage=critical,digitalSignature,keyEncipherment\n"
fi

# --- ownership: the caller's files, and the agent's copies -----------------------------------
chmod 0600 "$DIR"/job-secret "$DIR"/etcd-*password "$DIR"/s3-* "$DIR"/*.key
chmod 0644 "$DIR"/*.crt
if [ "$(id -u)" = 0 ]; then
    chown "$OWNER_UID:$OWNER_GID" "$DIR" "$DIR"/job-secret "$DIR"/etcd-*password "$DIR"/s3-* \
        "$DIR"/*.key "$DIR"/*.crt
fi
for f in job-secret etcd-password etcd-root-password client.key s3-credentials; do
    cp "$DIR/$f" "$DIR/agent/$f.tmp"
    chmod 0400 "$DIR/agent/$f.tmp"
    [ "$(id -u)" = 0 ] && chown "$AGENT_UID:$AGENT_GID" "$DIR/agent/$f.tmp"
    mv "$DIR/agent/$f.tmp" "$DIR/agent/$f"
done
chmod 0700 "$DIR/agent"
[ "$(id -u)" = 0 ] && chown "$AGENT_UID:$AGENT_GID" "$DIR/agent"
log "secrets in $DIR (agent copies in $DIR/agent, uid $AGENT_UID)"
