# syntax=docker/dockerfile:1.7
# Tandem's container image: one image runs every tier (`tandem encoder|language|router`).
#
#   docker build -t tandem:0.1.0-cuda .                      # GPU hosts (default)
#   docker build -t tandem:0.1.0-cpu --build-arg VARIANT=cpu .
#   docker build -t tandem:0.1.0-router --target router .    # the router alone: no torch,
#                                                             # no CUDA (the chart's default)
#
# The steps are the ones `make` runs (tests/test_deploy_dockerfile.py holds them together):
#   build stage    `make proto`: venv, the pinned torch first, the package with
#                  PIP_CONSTRAINT=constraints.txt, gRPC stubs generated from protos/;
#                  then a wheel of the package with its stubs inside.
#   runtime stage  the Debian libraries Mooncake links (make's sysdeps), a venv, the same
#                  pinned torch first, the wheel under the same constraints; the GPU variant
#                  swaps in the CUDA build of Mooncake (the plain package needs CUDA).
#   Every pip step, the router's too, resolves under constraints.txt (the lock, `make lock`):
#   the image holds the versions the suite last passed with. The CUDA build's own packages
#   (nvidia-*) follow from the pinned torch; Ubuntu 24.04's Python is 3.12 where the lock was
#   resolved on 3.11, so a pin without a 3.12 wheel would fail the build, not change a version.
# Built and run in the development environment with buildah, no Docker engine: `make image`,
# `make image-check` (the cpu variant and the router; the cuda variant's steps checked
# without CUDA: docs/deploy.md, "Built and run here").

ARG VARIANT=cuda
ARG CUDA_IMAGE=nvidia/cuda:12.8.1-runtime-ubuntu24.04
ARG CPU_IMAGE=ubuntu:24.04

FROM ${CUDA_IMAGE} AS base-cuda
FROM ${CPU_IMAGE} AS base-cpu

# ---- base: Python, and the libraries Mooncake's engine.so links even for TCP --------------
FROM base-${VARIANT} AS base
ENV DEBIAN_FRONTEND=noninteractive PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1
# libibverbs1 ibverbs-providers: the Makefile's sysdeps; libnuma1 and curl (libcurl) are the
# rest of what engine.so links on a slim base; tini forwards SIGTERM (drain) to the service.
RUN apt-get update \
 && apt-get install -y --no-install-recommends \
      python3 python3-venv libibverbs1 ibverbs-providers libnuma1 curl ca-certificates tini \
 && rm -rf /var/lib/apt/lists/*

# ---- build: `make proto` exactly as in development, then a wheel with the stubs ------------
FROM base AS build
ARG TORCH_SPEC=torch==2.13.0
ARG TORCH_CPU_INDEX=https://download.pytorch.org/whl/cpu
RUN apt-get update && apt-get install -y --no-install-recommends make \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY Makefile pyproject.toml setup.py MANIFEST.in constraints.txt README.md ./
COPY protos ./protos
COPY tandem ./tandem
COPY services ./services
# Stubs need only grpcio-tools, so the build venv always takes the CPU torch build.
RUN PIP_EXTRA_INDEX_URL="$TORCH_CPU_INDEX" \
    make proto PYTHON=python3 VENV=/opt/build TORCH_SPEC="${TORCH_SPEC}+cpu"
RUN /opt/build/bin/pip wheel --no-deps --no-build-isolation --wheel-dir /wheels .

# ---- runtime --------------------------------------------------------------------------------
# ---- router: the front door alone on a plain CPU base (`--target router`) ---------------
# No torch, transformers, Mooncake or CUDA: the package's `router` extra. Built before the
# runtime stage so that a plain `docker build` still ends with the full image.
FROM ${CPU_IMAGE} AS router
ENV DEBIAN_FRONTEND=noninteractive PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv ca-certificates tini \
 && rm -rf /var/lib/apt/lists/*
COPY --from=build /wheels /wheels
COPY constraints.txt /opt/constraints.txt
RUN export PIP_CONSTRAINT=/opt/constraints.txt \
 && python3 -m venv /opt/venv && /opt/venv/bin/pip install -q --upgrade pip \
 && /opt/venv/bin/pip install -q "$(ls /wheels/tandem_vlm-*.whl)[router]" \
 && /opt/venv/bin/python -c "import sys, tandem.services.router.main; assert 'torch' not in sys.modules" \
 && rm -rf /wheels
RUN groupadd --gid 10001 tandem && useradd --uid 10001 --gid 10001 --create-home tandem
ENV PATH=/opt/venv/bin:$PATH PYTHONUNBUFFERED=1
USER 10001:10001
WORKDIR /home/tandem
EXPOSE 8000 50051
ENTRYPOINT ["/usr/bin/tini", "--", "tandem"]
CMD ["router", "--help"]

FROM base AS runtime
ARG VARIANT
ARG TORCH_SPEC=torch==2.13.0
ARG TORCH_CPU_INDEX=https://download.pytorch.org/whl/cpu
ARG MOONCAKE_CUDA_SPEC="mooncake-transfer-engine>=0.3.7"
ARG XGRAMMAR_SPEC="xgrammar>=0.2.8,<0.3"
COPY --from=build /wheels /wheels
COPY constraints.txt /opt/constraints.txt
RUN python3 -m venv /opt/venv \
 && PIP_CONSTRAINT=/opt/constraints.txt /opt/venv/bin/pip install -q --upgrade pip
# torch first, from the pinned build, so nothing later can pull another one (as make does).
# PyPI's default torch wheel is the CUDA build; the cpu variant takes the +cpu build.
RUN if [ "$VARIANT" = cpu ]; then \
      PIP_EXTRA_INDEX_URL="$TORCH_CPU_INDEX" /opt/venv/bin/pip install -q "${TORCH_SPEC}+cpu"; \
    else \
      /opt/venv/bin/pip install -q "$TORCH_SPEC"; \
    fi
RUN PIP_CONSTRAINT=/opt/constraints.txt /opt/venv/bin/pip install -q "$(ls /wheels/tandem_vlm-*.whl)[server]"
# The grammar engine: whole on CUDA (its triton kernels), without triton on CPU (1 GB the
# CPU path never imports; see pyproject.toml).
RUN if [ "$VARIANT" = cuda ]; then \
      PIP_CONSTRAINT=/opt/constraints.txt /opt/venv/bin/pip install -q "$XGRAMMAR_SPEC"; \
    else \
      PIP_CONSTRAINT=/opt/constraints.txt /opt/venv/bin/pip install -q --no-deps "$XGRAMMAR_SPEC"; \
    fi
# NOTE: both Mooncake packages install the same `mooncake` module: remove the CPU build
# before installing the CUDA one, never after (that would delete the new files). The CUDA
# engine is not imported here: it may need the driver, which a build host need not have.
RUN if [ "$VARIANT" = cuda ]; then \
      /opt/venv/bin/pip uninstall -y -q mooncake-transfer-engine-non-cuda \
      && PIP_CONSTRAINT=/opt/constraints.txt /opt/venv/bin/pip install -q --no-deps "$MOONCAKE_CUDA_SPEC"; \
    fi \
 && /opt/venv/bin/python -c "import tandem.v1.encoder_pb2, tandem.services.encoder.config" \
 && rm -rf /wheels

# Both variants carry a compiler and Python's headers. CPU: the language tier builds its CPU
# kernels (paged decode attention, packed float32 linears: ~2x faster decode) for its node's
# CPU on first start (~60 s, kept in TANDEM_KERNEL_DIR); without them it would serve with
# torch's slower ops. CUDA: attention is compiled flex_attention (Triton), whose kernel
# launchers are C built on first use, as are xgrammar's Triton kernels.
RUN apt-get update && apt-get install -y --no-install-recommends g++ python3-dev \
 && rm -rf /var/lib/apt/lists/*
# Same uid as the Helm chart's podSecurityContext.runAsUser.
RUN groupadd --gid 10001 tandem && useradd --uid 10001 --gid 10001 --create-home tandem \
 && mkdir -p /cache/huggingface /cache/kernels && chown -R tandem:tandem /cache
ENV PATH=/opt/venv/bin:$PATH PYTHONUNBUFFERED=1 HF_HOME=/cache/huggingface \
    TANDEM_KERNEL_DIR=/cache/kernels
USER 10001:10001
WORKDIR /home/tandem
# encoder gRPC, language gRPC, router HTTP + gRPC, metrics
EXPOSE 50061 50071 8000 50051 9090
ENTRYPOINT ["/usr/bin/tini", "--", "tandem"]
CMD ["--help"]
