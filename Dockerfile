# syntax=docker/dockerfile:1
# visenc service image, CPU (default) or CUDA:
#   docker build -t visenc:cpu .
#   docker build -t visenc:cuda --build-arg BASE=cuda .
# BASE picks the base image and the matching torch wheels (PyTorch's CPU index or its CUDA index);
# the torch version is the one pinned in pyproject.toml.

ARG BASE=cpu
# (hadolint's DL3006 below: base-${BASE} names a stage of this file, tagged where it is defined)

# ---- bases: each flavour's build and runtime stages start from the same image ----------------------
FROM python:3.12-slim-bookworm AS base-cpu
ENV TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu

FROM nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04 AS base-cuda
ENV TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 \
    NVIDIA_VISIBLE_DEVICES=all \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility
# torch.compile (on by default on CUDA) needs at run time what Triton builds its kernel launcher with:
# a C compiler (gcc; libc6-dev for its headers) and the headers of the Python that runs (python3-dev,
# the same python3 the venv is made from); libcuda.so.1 comes from the host's driver (NVIDIA toolkit).
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv python3-dev gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*

# ---- deps: third-party dependencies only, rebuilt only when pyproject.toml changes ----------------
# hadolint ignore=DL3006
FROM base-${BASE} AS deps
ENV PATH=/opt/venv/bin:$PATH \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
RUN python3 -m venv /opt/venv
COPY pyproject.toml ./
# torch first, from the index that matches the base; then every other runtime dependency (torch's pin is
# already satisfied, so PyPI's default build is never pulled in)
RUN python3 -c "import tomllib; print('\n'.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']))" \
        > /tmp/requirements.txt \
    && pip install --index-url "$TORCH_INDEX_URL" "$(grep -E '^torch([=<>~! ]|$)' /tmp/requirements.txt)" \
    && pip install -r /tmp/requirements.txt

# ---- build: the project itself (a source change rebuilds only from here) --------------------------
FROM deps AS build
COPY README.md ./
COPY service ./service
COPY clients ./clients
RUN pip install --no-deps .

# ---- runtime: the venv on a clean base, a non-root user --------------------------------------------
# hadolint ignore=DL3006
FROM base-${BASE} AS runtime
# HF_HOME (the hub cache and visenc's vision-only files) owned by the user: a volume mounted there is writable
RUN groupadd --system --gid 10001 visenc \
    && useradd --system --uid 10001 --gid visenc --create-home --home-dir /home/visenc visenc \
    && install -d -o visenc -g visenc /home/visenc/.cache /home/visenc/.cache/huggingface \
    && mkdir -p /var/cache/visenc/inductor /var/cache/visenc/triton \
    && chown -R 10001:10001 /var/cache/visenc
COPY --from=build /opt/venv /opt/venv
# the compile caches (inductor's graphs, Triton's kernels) live on /var/cache/visenc: mount a volume
# there (deploy/) so a restart does not compile again
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    HF_HOME=/home/visenc/.cache/huggingface \
    TORCHINDUCTOR_CACHE_DIR=/var/cache/visenc/inductor \
    TRITON_CACHE_DIR=/var/cache/visenc/triton \
    VISENC_PORT=8000
WORKDIR /home/visenc
USER 10001:10001
EXPOSE 8000
# liveness only (the process answers); readiness (/readyz: model loaded, worker alive) is for balancers
HEALTHCHECK --interval=15s --timeout=5s --start-period=120s --retries=3 \
    CMD ["python3", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/healthz' % os.environ.get('VISENC_PORT', '8000'), timeout=4)"]
CMD ["visenc", "serve", "--host", "0.0.0.0"]
