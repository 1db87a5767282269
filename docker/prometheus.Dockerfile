# Prometheus from Debian's package, for docker/compose.yaml where prom/prometheus cannot be pulled; used as that
# image is (its entrypoint, user nobody, data in /prometheus). No build context:
#   docker build -t s2tts-prometheus --build-arg BASE=s2tts-debian:bookworm - < docker/prometheus.Dockerfile
ARG BASE=debian:bookworm-slim
FROM ${BASE} AS package
RUN apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends prometheus

# the server alone (a static binary): the package's web assets and their dependencies stay behind
FROM ${BASE}
COPY --from=package /usr/bin/prometheus /usr/bin/prometheus
RUN mkdir -p /prometheus /etc/prometheus && chown nobody:nogroup /prometheus
USER nobody
EXPOSE 9090
ENTRYPOINT ["prometheus"]
CMD ["--config.file=/etc/prometheus/prometheus.yml", "--storage.tsdb.path=/prometheus"]
