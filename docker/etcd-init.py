#!/usr/bin/env python3
"""Turn on etcd's authentication for docker-compose.yml (its one-shot ``etcd-init`` service).

Creates (or updates) two etcd users and enables auth, idempotently, on every ``up``:

* ``root`` with the password of ``$ETCD_ROOT_PASSWORD_FILE`` (etcd needs it to enable auth);
* ``$ETCD_USER`` (default ``elastic``) with the password of ``$ETCD_PASSWORD_FILE`` and one
  role, ``$ETCD_USER-rw``: read and write under ``$ETCD_PREFIX`` (default ``/elastic/``, where
  the rendezvous keeps every run's keys) and nothing else.

On a fresh etcd it connects without credentials; once auth is on, as root (a root password
that no longer matches says so: the etcd volume was set up with other secrets). Passwords go
to etcd over TLS in gRPC messages, never on a command line or in a log.

Env: ETCD_ENDPOINT (default etcd:2379), ETCD_CACERT, ETCD_CERT, ETCD_KEY (TLS; plain http
without ETCD_CACERT), ETCD_ROOT_PASSWORD_FILE, ETCD_PASSWORD_FILE, ETCD_USER, ETCD_PREFIX.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import grpc
from etcd3 import etcdrpc
from etcd3.etcdrpc import auth_pb2

from elastic.errors import EtcdConnectionError
from elastic.etcd.client import EtcdClient, EtcdOptions, parse_endpoints


def log(message: str) -> None:
    print(f"[etcd-init] {message}", flush=True)


def read_secret(variable: str) -> str:
    path = os.environ.get(variable)
    if not path:
        sys.exit(f"[etcd-init] ${variable} is not set")
    try:
        value = Path(path).read_text().strip()
    except OSError as exc:
        sys.exit(f"[etcd-init] cannot read {path} (${variable}): {exc.strerror}")
    if not value:
        sys.exit(f"[etcd-init] {path} (${variable}) is empty")
    return value


def prefix_end(prefix: bytes) -> bytes:
    end = bytearray(prefix)
    while end and end[-1] == 0xFF:
        end.pop()
    if not end:
        return b"\0"
    end[-1] += 1
    return bytes(end)


def options(user: str | None = None, password: str | None = None) -> EtcdOptions:
    endpoints, https = parse_endpoints(os.environ.get("ETCD_ENDPOINT", "etcd:2379"))
    cacert = os.environ.get("ETCD_CACERT") or None
    return EtcdOptions(
        endpoints=endpoints,
        tls=https or bool(cacert),
        ca_cert=cacert,
        cert=os.environ.get("ETCD_CERT") or None,
        key=os.environ.get("ETCD_KEY") or None,
        user=user,
        password=password,
        connect_timeout=10.0,
        request_timeout=30.0,
    )


def auth_call(client: EtcdClient, method: str, request: object) -> object:
    """One Auth RPC, with the login token of the client's user (if any)."""
    return client.call(
        lambda c, t: getattr(c.auth, method)(request, timeout=t, metadata=c.metadata)
    )


def auth_enabled(client: EtcdClient) -> bool:
    """Whether etcd already refuses a request without a login (etcd 3.5 has no AuthStatus in
    the stubs we ship)."""
    try:
        auth_call(client, "UserList", etcdrpc.AuthUserListRequest())
    except grpc.RpcError as exc:
        if exc.code() in (
            grpc.StatusCode.PERMISSION_DENIED,
            grpc.StatusCode.INVALID_ARGUMENT,  # "user name is empty"
            grpc.StatusCode.UNAUTHENTICATED,
            grpc.StatusCode.FAILED_PRECONDITION,
        ):
            return True
        raise
    return False


def tolerate(exc: grpc.RpcError, *phrases: str) -> bool:
    details = (exc.details() or "").lower()
    return any(p in details for p in phrases)


def login_works(anonymous: EtcdClient, name: str, password: str) -> bool:
    """Whether etcd (auth on) accepts ``password`` for ``name``; changes nothing."""
    try:
        auth_call(
            anonymous, "Authenticate", etcdrpc.AuthenticateRequest(name=name, password=password)
        )
    except grpc.RpcError as exc:
        if tolerate(exc, "invalid user id or password", "authentication failed"):
            return False
        raise
    return True


# Every change to users, roles or permissions bumps etcd's auth revision, and etcd then refuses
# the requests of every logged-in client once ("revision of auth store is old") until it logs
# in again: so change only what differs. An `up` that adds an agent reruns this service while
# the others train.
def ensure_user(
    client: EtcdClient, anonymous: EtcdClient, enabled: bool, name: str, password: str, role: str
) -> None:
    try:
        roles = list(auth_call(client, "UserGet", etcdrpc.AuthUserGetRequest(name=name)).roles)
    except grpc.RpcError as exc:
        if not tolerate(exc, "user name not found"):
            raise
        auth_call(client, "UserAdd", etcdrpc.AuthUserAddRequest(name=name, password=password))
        log(f"user {name} created")
        roles = []
    else:
        if not enabled or not login_works(anonymous, name, password):
            auth_call(
                client,
                "UserChangePassword",
                etcdrpc.AuthUserChangePasswordRequest(name=name, password=password),
            )
            log(f"user {name}: password set from its secret file")
    if role not in roles:
        auth_call(client, "UserGrantRole", etcdrpc.AuthUserGrantRoleRequest(user=name, role=role))
        log(f"user {name}: role {role} granted")


def ensure_role(client: EtcdClient, role: str, prefix: bytes) -> None:
    """``role`` may read and write the keys under ``prefix``."""
    wanted = auth_pb2.Permission(
        permType=auth_pb2.Permission.READWRITE, key=prefix, range_end=prefix_end(prefix)
    )
    try:
        perms = list(auth_call(client, "RoleGet", etcdrpc.AuthRoleGetRequest(role=role)).perm)
    except grpc.RpcError as exc:
        if not tolerate(exc, "role name not found"):
            raise
        auth_call(client, "RoleAdd", etcdrpc.AuthRoleAddRequest(name=role))
        log(f"role {role} created")
        perms = []
    if wanted not in perms:
        auth_call(
            client,
            "RoleGrantPermission",
            etcdrpc.AuthRoleGrantPermissionRequest(name=role, perm=wanted),
        )
        log(f"role {role}: read/write under {prefix.decode()} granted")


def main() -> int:
    root_password = read_secret("ETCD_ROOT_PASSWORD_FILE")
    user = os.environ.get("ETCD_USER", "elastic")
    password = read_secret("ETCD_PASSWORD_FILE")
    prefix = os.environ.get("ETCD_PREFIX", "/elastic/").encode()
    if user == "root":
        sys.exit("[etcd-init] $ETCD_USER must not be root: the agents get their own user")
    role = f"{user}-rw"

    deadline = time.monotonic() + 120
    while True:
        try:
            with EtcdClient(options()) as probe:
                enabled = auth_enabled(probe)
            break
        except EtcdConnectionError as exc:
            if time.monotonic() > deadline:
                raise
            log(f"waiting for etcd: {exc}")
            time.sleep(1)

    anonymous = EtcdClient(options())
    client = EtcdClient(options("root", root_password) if enabled else options())
    try:
        if enabled:
            log("auth is enabled; logging in as root")
        ensure_user(client, anonymous, enabled, "root", root_password, "root")
        ensure_role(client, role, prefix)
        ensure_user(client, anonymous, enabled, user, password, role)
        if not enabled:
            auth_call(client, "AuthEnable", etcdrpc.AuthEnableRequest())
            log("auth enabled")
        log(f"user {user} may read and write {prefix.decode()}* only")
    except EtcdConnectionError as exc:
        if enabled and "refused the login" in str(exc):
            sys.exit(
                "[etcd-init] etcd refused root's password from $ETCD_ROOT_PASSWORD_FILE: its "
                "volume was set up with other secrets. Restore them, or start afresh with "
                "`docker compose down -v` (this deletes the rendezvous state)."
            )
        raise
    finally:
        client.close()
        anonymous.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
