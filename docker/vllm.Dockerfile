# vLLM with the kvcache connector (kvcache_connectors.vllm) and SDK. Build from the repository root:
#   docker build -f docker/vllm.Dockerfile -t vllm-kvcache .
FROM vllm/vllm-openai:v0.33.0

ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1

COPY pyproject.toml README.md /tmp/kvcache/
COPY kvcache_server /tmp/kvcache/kvcache_server
COPY kvcache_core /tmp/kvcache/kvcache_core
COPY kvcache_proto /tmp/kvcache/kvcache_proto
COPY kvcache_router /tmp/kvcache/kvcache_router
COPY client /tmp/kvcache/client
COPY connectors /tmp/kvcache/connectors
# --no-deps: the image's torch, numpy and CUDA stack stay as vLLM ships them. The second pip adds the
# SDK's own dependencies (pyproject.toml [project] dependencies; tests/test_docker.py keeps the lists equal).
RUN python3 -m pip install --no-deps /tmp/kvcache \
 && python3 -m pip install "grpcio>=1.85.1" "grpcio-health-checking>=1.85.1" "grpcio-reflection>=1.85.1" \
        "protobuf>=7.35.1,<8" "xxhash>=3.4" "numpy>=1.26" "lz4>=4.3" "prometheus-client>=0.20" \
 && rm -rf /tmp/kvcache \
 && python3 -c "import kvcache_client, kvcache_connectors.vllm"
