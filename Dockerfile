# syntax=docker/dockerfile:1
# Targets: `runtime` (default, last stage) runs a worker; `analytics` snapshots
# and analyzes (docker-compose.yml, profile `analytics`).
#
# bookworm rather than the floating `python:3.11-slim` tag, so the Debian base
# does not move under the image (trixie, which that tag moved to, no longer ships
# openjdk-17, the JRE Spark 3.5 supports: the analytics image will need it).
FROM python:3.11-slim-bookworm AS base
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY . /src
RUN pip install --no-cache-dir .
EXPOSE 7379
# No entrypoint wrapper: compose's `command:` is the whole command line.
ENTRYPOINT []
CMD ["fencemq", "serve", "--host", "0.0.0.0"]

# The analytics job: Java 17 for Spark, and the spark extra (pyspark, pyarrow, matplotlib).
FROM base AS analytics
RUN apt-get update \
    && apt-get install -y --no-install-recommends openjdk-17-jre-headless \
    && rm -rf /var/lib/apt/lists/* \
    && pip install --no-cache-dir '.[spark]'
ENV PYSPARK_PYTHON=python3
CMD ["fencemq", "analyze", "/data/snapshot", "--out", "/data/report"]

FROM base AS runtime
