# Prometheus for docker-compose.yml's `monitoring` profile: Debian's prometheus package on the
# project's base image, without a registry. docker/build-base.sh builds it as
# elastic-prometheus:local from a context holding this file (as Dockerfile), prometheus.yml and
# debs/: the .deb files of prometheus and of what the base lacks of its dependencies. With an
# empty debs/ the package comes from the distribution's mirror (apt-get) instead.
ARG BASE_IMAGE=elastic-base:bookworm
FROM ${BASE_IMAGE}
COPY debs/ /tmp/debs/
# policy-rc.d: the package's scripts must not try to start a service during the build.
RUN set -eux; \
    printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d; \
    chmod 0755 /usr/sbin/policy-rc.d; \
    if ls /tmp/debs/*.deb >/dev/null 2>&1; then \
        dpkg -i /tmp/debs/*.deb; \
    else \
        apt-get update; \
        DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends prometheus; \
        rm -rf /var/lib/apt/lists/*; \
    fi; \
    rm -rf /tmp/debs /usr/sbin/policy-rc.d; \
    install -d -o prometheus -g prometheus /prometheus; \
    prometheus --version
COPY prometheus.yml /etc/prometheus/prometheus.yml
USER prometheus
WORKDIR /prometheus
EXPOSE 9090
# The same paths and flags as the upstream prom/prometheus image, so docker-compose.yml's
# command works with either.
ENTRYPOINT ["/usr/bin/prometheus"]
CMD ["--config.file=/etc/prometheus/prometheus.yml", "--storage.tsdb.path=/prometheus", "--web.listen-address=:9090"]
