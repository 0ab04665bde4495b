# syntax=docker/dockerfile:1
# gqa-serve image. Two targets share one layout (/opt/venv, user 10001, exec-form entrypoint):
#   cpu  (default, the last stage)  torch's CPU wheel; no CUDA libraries in the image
#   cuda                            torch's CUDA wheel (it bundles the CUDA runtime libraries;
#                                   the driver comes from the node via the NVIDIA runtime),
#                                   plus triton and the C compiler triton builds its launcher with
#   docker build -t gqa-serve:cpu .
#   docker build --target cuda -t gqa-serve:cuda .
# The service reads every setting from GQA_* variables (see service/config.py); the image only
# sets the address so that it listens beyond loopback.

# Pin a digest here (python:3.11-slim@sha256:...) for reproducible production builds.
ARG PYTHON_IMAGE=python:3.11-slim

# ---- build: a virtual environment in /opt/venv, copied whole into the runtime stages -------
FROM ${PYTHON_IMAGE} AS build-base
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PATH=/opt/venv/bin:$PATH
RUN python -m venv /opt/venv
WORKDIR /src
COPY pyproject.toml README.md ./
COPY service ./service
COPY backends ./backends
COPY quant ./quant
# The Python client, a distribution of its own (gqa-serve-client): the server's `demo` and `bench`
# commands depend on it, and pip takes it from here in the same install as the server.
COPY clients/python ./clients/python

FROM build-base AS build-cpu
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
# The int8 backend's C kernel is compiled here, into the venv, so the runtime image needs no
# compiler (GQA_KERNEL_CACHE below). It takes no -march flag: it runs on any x86-64 node and
# picks its AVX-512 path at run time. g++ builds the public step's C++ entry beside it
# (backends/csrc/torch_step.cpp, against the venv's torch); the build's object cache stays
# behind. Debian packages are not version-pinned: the base image fixes the release, and a pin
# would break rebuilds when Debian replaces a version.
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends gcc g++ libc6-dev \
 && rm -rf /var/lib/apt/lists/*
# torch first, from the CPU index, so that the project's exact pin is already satisfied by the
# CPU build and pip never reaches for the multi-GB default (CUDA) wheel.
RUN pip install --no-cache-dir --index-url "${TORCH_INDEX_URL}" "torch==2.13.0" \
 && pip install --no-cache-dir --extra-index-url "${TORCH_INDEX_URL}" /src/clients/python /src \
 && python -m backends.native build /opt/venv/lib/gqa-kernels \
 && rm -rf /opt/venv/lib/gqa-kernels/objects

FROM build-base AS build-cuda
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128
RUN pip install --no-cache-dir --index-url "${TORCH_INDEX_URL}" "torch==2.13.0" \
 && pip install --no-cache-dir --extra-index-url "${TORCH_INDEX_URL}" /src/clients/python "/src[triton]"

# ---- runtime ---------------------------------------------------------------------------------
FROM ${PYTHON_IMAGE} AS runtime-base
# A numeric user, so that Kubernetes' runAsNonRoot can check it without reading /etc/passwd.
RUN groupadd --system --gid 10001 gqa \
 && useradd --system --uid 10001 --gid 10001 --home-dir /tmp --no-create-home --shell /usr/sbin/nologin gqa
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    HOME=/tmp \
    GQA_ADDRESS=0.0.0.0:50051 \
    GQA_METRICS_PORT=9464
WORKDIR /tmp
EXPOSE 50051 9464
# Healthy once the backends are probed and while not draining: GET /readyz on the metrics port
# (HTTP health follows the gRPC health status; service/metrics/pages.py). No curl in the image:
# the venv's python asks. It needs metrics on (GQA_METRICS_PORT nonzero).
HEALTHCHECK --interval=10s --timeout=5s --start-period=120s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; host = os.environ.get('GQA_METRICS_HOST', '') or '127.0.0.1'; host = '127.0.0.1' if host in ('0.0.0.0', '::', '[::]') else host; urllib.request.urlopen('http://%s:%s/readyz' % (host, os.environ.get('GQA_METRICS_PORT', '9464')), timeout=4)"]

FROM runtime-base AS cuda
# triton compiles a small C launcher on first use (its cache goes to the writable /tmp). Not
# version-pinned: Debian replaces package versions within a release, so a pin would break
# rebuilds; the base image fixes the release.
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends gcc libc6-dev \
 && rm -rf /var/lib/apt/lists/*
COPY --from=build-cuda /opt/venv /opt/venv
ENV GQA_BACKEND=cuda \
    TRITON_CACHE_DIR=/tmp/triton \
    NVIDIA_VISIBLE_DEVICES=all \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility
USER 10001:10001
ENTRYPOINT ["/opt/venv/bin/gqa-serve", "serve"]

FROM runtime-base AS cpu
COPY --from=build-cpu /opt/venv /opt/venv
ENV GQA_KERNEL_CACHE=/opt/venv/lib/gqa-kernels
USER 10001:10001
ENTRYPOINT ["/opt/venv/bin/gqa-serve", "serve"]
