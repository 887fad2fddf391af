# syntax=docker/dockerfile:1
# Targets: `runtime` (default, last stage) runs a worker; `analytics` adds a JRE
# and PySpark for `fencemq analyze`.
#
# bookworm rather than the floating `python:3.11-slim` tag: that tag moved to
# Debian trixie, which no longer ships openjdk-17 (the JRE Spark 3.5 supports).
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

FROM base AS analytics
# The man dir is missing on slim images and the JRE's postinst expects it.
RUN mkdir -p /usr/share/man/man1 \
 && apt-get update \
 && apt-get install -y --no-install-recommends openjdk-17-jre-headless \
 && rm -rf /var/lib/apt/lists/*
RUN pip install --no-cache-dir ".[spark]"
ENV PYSPARK_PYTHON=python3
CMD ["fencemq", "analyze", "/snapshots", "--out", "/reports"]

FROM base AS runtime
