# inference-lab in a container: `inference-lab serve` on 0.0.0.0:8000 as a non-root user.
# Build from the checkout:   docker build -t inference-lab .
# Run:                       docker run --rm -p 8000:8000 inference-lab
# Other flags or commands:   docker run --rm -p 8000:8000 inference-lab serve --host 0.0.0.0 \
#                              --port 8000 --config gpt-oss-20b --max-num-seqs 64
# docs/deploy.md covers the image, the Kubernetes manifests in deploy/ and a fleet.

ARG PYTHON_IMAGE=python:3.12-slim-bookworm

# Stage 1: install the package from this source tree into a virtual environment.
FROM ${PYTHON_IMAGE} AS build
# the optional extras to install (pyproject.toml): kv-events publishes KV-cache events over
# ZeroMQ (--kv-events-endpoint, what llm-d's KV-cache indexer reads); add "tokenizer" for
# --tokenizer with real tokenizer files
ARG EXTRAS=kv-events
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/inference-lab
WORKDIR /src
COPY pyproject.toml README.md ./
COPY inference_lab ./inference_lab
COPY configs ./configs
COPY hardware_profiles ./hardware_profiles
RUN /opt/inference-lab/bin/pip install --no-cache-dir "/src[${EXTRAS}]"

# Stage 2: the runtime image, the environment without the sources or the build tools.
FROM ${PYTHON_IMAGE}
ENV PATH=/opt/inference-lab/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    INFERENCE_LAB_HEALTH_URL=http://127.0.0.1:8000/health
COPY --from=build /opt/inference-lab /opt/inference-lab
RUN useradd --system --uid 10001 --user-group --create-home --home-dir /home/inference-lab \
        --shell /usr/sbin/nologin inference-lab
USER 10001:10001
WORKDIR /home/inference-lab
EXPOSE 8000
# /health answers 200 while every model's engine runs and 503 once one has stopped or a
# shutdown began; urlopen raises on anything but 2xx, so the check exits 1. Only the
# image's own python is used (no curl). Serving on another port: set
# INFERENCE_LAB_HEALTH_URL to match.
HEALTHCHECK --interval=10s --timeout=3s --start-period=20s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen(os.environ['INFERENCE_LAB_HEALTH_URL'], timeout=2)"]
# `inference-lab serve` handles SIGTERM itself (a graceful drain, docs/serve.md#shutdown),
# so it runs as PID 1 without an init.
ENTRYPOINT ["inference-lab"]
CMD ["serve", "--host", "0.0.0.0", "--port", "8000"]
