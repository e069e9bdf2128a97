# A local S3 server for the `s3` profile where MinIO's image cannot be pulled (CI): moto's
# server mode on any base image with python3 + venv. Context: a directory `wheels/` holding
# moto[server] and its dependencies (docker/build-base.sh makes it), or empty to use PyPI.
#   S3_IMAGE=elastic-moto:local S3_COMMAND='-H 0.0.0.0 -p 9000' docker compose --profile s3 up
ARG BASE_IMAGE=elastic-base:bookworm
FROM ${BASE_IMAGE}
ARG PIP_ARGS=""
COPY wheels/ /tmp/wheels/
RUN python3 -m venv /opt/moto \
    && /opt/moto/bin/pip install --no-cache-dir $PIP_ARGS --find-links /tmp/wheels 'moto[server]' \
    && rm -rf /tmp/wheels
EXPOSE 9000
ENTRYPOINT ["/opt/moto/bin/moto_server"]
CMD ["-H", "0.0.0.0", "-p", "9000"]
