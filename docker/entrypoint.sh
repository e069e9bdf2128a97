#!/bin/sh
# Container entrypoint: run elastic-agent as PID 1 with this node's own address.
#
#   elastic-entrypoint [elastic-agent options...] -m elastic_tools.training.worker ...   -> exec elastic-agent
#   elastic-entrypoint elastic status --etcd etcd:2379 --run-id compose   -> exec that command
#
# A container's hostname is its id; torch elastic would advertise that to its peers, so we add
# --local-addr=<the container's IP> (or $ELASTIC_LOCAL_ADDR) unless the options set one.
# $ELASTIC_AGENT_EXTRA_ARGS (split on spaces) is appended: worker overrides like job.max_steps=50.
set -eu
case "${1:-}" in
    -*|"") ;;
    elastic-agent) shift ;;
    *) exec "$@" ;;
esac
case " $* " in
    *" --local-addr"*|*" --local_addr"*) ;;
    *)
        addr="${ELASTIC_LOCAL_ADDR:-$(python3 -c 'import socket; print(socket.gethostbyname(socket.gethostname()))')}"
        set -- "--local-addr=$addr" "$@"
        ;;
esac
set -f  # no globbing of the extra args
# shellcheck disable=SC2086
exec elastic-agent "$@" ${ELASTIC_AGENT_EXTRA_ARGS:-}
