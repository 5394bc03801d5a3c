# syntax=docker/dockerfile:1
#
# The pipeline in a container. Usage: docker/entrypoint.sh, or `docker run IMAGE help`.
#
# GPU image (default): a CUDA PyTorch base whose torch is kept as it is.
#   docker build -t llm-pipeline .
# CPU image (CI, laptops): plain Python plus the CPU torch pinned in constraints.txt.
#   docker build -t llm-pipeline:cpu --build-arg BASE_IMAGE=python:3.11-slim .
# Test image: the same plus the dev extras (pytest, hadolint).
#   docker build -t llm-pipeline:dev --target dev --build-arg BASE_IMAGE=python:3.11-slim .
#
# Build args
#   BASE_IMAGE       any Debian/Ubuntu image with Python >= 3.10 and pip; pin it by
#                    digest (name:tag@sha256:...) for a reproducible build
#   CONSTRAINTS      the pins file, as for `make install CONSTRAINTS=...`; its torch
#                    pin is replaced by the image's own torch (docker/image-constraints.sh)
#   TORCH_INDEX_URL  where to get torch when the base image has none (CPU wheels by default)
#   APP_UID          the numeric user the container runs as (match your host user so
#                    files written into a mounted checkout stay yours)
#   EXTRAS           the package's optional extras to install (default ray, for
#                    executor.kind: ray; empty for none)
#   GIT_COMMIT       recorded as the image's org.opencontainers.image.revision label
#
# An ARG lives in the stage that declares it. The ones every stage uses are
# declared here, before the first FROM, and again (without a value) in each
# stage that reads them: without that, `USER ${APP_UID}` in a later stage reads
# an empty value and the container runs as root.
ARG BASE_IMAGE=pytorch/pytorch:2.9.0-cuda12.8-cudnn9-runtime
ARG APP_UID=1000

FROM ${BASE_IMAGE} AS base

ARG APP_UID
ARG CONSTRAINTS=constraints.txt
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG EXTRAS=ray
ARG GIT_COMMIT=unknown

LABEL org.opencontainers.image.title="llm-pipeline" \
      org.opencontainers.image.description="ingest -> clean -> tokenizer -> pack -> pretrain -> sft -> evaluate -> export" \
      org.opencontainers.image.revision="${GIT_COMMIT}"

ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PREFECT_SERVER_ANALYTICS_ENABLED=false \
    PREFECT_HOME=/workspace/.prefect

SHELL ["/bin/bash", "-o", "pipefail", "-c"]

# git: DVC needs it for a mounted checkout, and the MLflow runs record the commit.
# tini: PID 1 that forwards `docker stop`'s SIGTERM to the pipeline, so DVC and
# the trainer shut down cleanly instead of being SIGKILLed after the grace period.
# Versions are not pinned: the base image is a build arg (Ubuntu for CUDA, Debian
# for CPU), so no single version string exists; pin BASE_IMAGE by digest instead.
# safe.directory: a checkout mounted from the host belongs to another user, and
# git (hence DVC and the lineage tags) would refuse to read it.
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends git tini \
 && rm -rf /var/lib/apt/lists/* \
 && git config --system --add safe.directory '*' \
 && (getent passwd "${APP_UID}" >/dev/null || useradd --create-home --uid "${APP_UID}" --shell /bin/bash pipeline)

# Dependencies first, in their own layer: they change far less often than the code.
# With only pyproject.toml present the package itself is empty; that is enough
# for pip to resolve and install every dependency.
WORKDIR /tmp/build
COPY pyproject.toml README* ${CONSTRAINTS} docker/image-constraints.sh ./
RUN bash image-constraints.sh "$(basename "${CONSTRAINTS}")" /tmp/constraints-image.txt "${TORCH_INDEX_URL}" \
 && python -m pip install --no-cache-dir -c /tmp/constraints-image.txt ".${EXTRAS:+[${EXTRAS}]}" \
 && python -m pip uninstall -y llm-pipeline \
 && rm -rf /tmp/build

# The project. An editable install points the package at /workspace, so a
# checkout mounted there is the code that runs.
WORKDIR /workspace
COPY --chown=${APP_UID} . .
RUN python -m pip install --no-cache-dir --no-deps -c /tmp/constraints-image.txt -e . \
 && install -m 0755 docker/entrypoint.sh /usr/local/bin/pipeline-entrypoint \
 && chown "${APP_UID}" /workspace

ENTRYPOINT ["/usr/bin/tini", "--", "/usr/local/bin/pipeline-entrypoint"]
CMD ["repro"]

# Test image: the dev extras on top (`docker run IMAGE python -m pytest -m "not slow"`).
FROM base AS dev
ARG APP_UID
RUN python -m pip install --no-cache-dir -c /tmp/constraints-image.txt -e '.[dev]'
USER ${APP_UID}

# Default target, last so that a plain `docker build` builds it.
FROM base AS runtime
ARG APP_UID
USER ${APP_UID}
