# kvcache-router: the OpenAI endpoint in front of the prefill and decode workers (docs/router.md).
# Build from the repository root:
#   docker build -f docker/router.Dockerfile -t kvcache-router .
# docker/docker-compose.yml mounts docker/router.toml at /etc/kvcache/router.toml.
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# Only what the package is built from; tests, benchmarks and the venv stay out of the image.
COPY pyproject.toml README.md /src/
COPY kvcache_core /src/kvcache_core
COPY kvcache_server /src/kvcache_server
COPY kvcache_proto /src/kvcache_proto
COPY client /src/client
COPY connectors /src/connectors
COPY kvcache_router /src/kvcache_router
# The router and the SDK it looks prompts up with; no torch, no tiers.
RUN pip install "/src[router]" && rm -rf /src

RUN useradd --system --uid 10002 --user-group --no-create-home --shell /usr/sbin/nologin kvcache-router
USER 10002:10002

EXPOSE 8000

# 200 while a decode worker is in rotation (GET /health).
HEALTHCHECK --interval=10s --timeout=5s --start-period=15s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=3)"]

ENTRYPOINT ["kvcache-router"]
CMD ["--config", "/etc/kvcache/router.toml"]
