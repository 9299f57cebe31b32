#!/usr/bin/env bash
# Installs lmcache==0.5.6 for CPU-only use (tests/lmcache: the L2 adapter and `lmcache server`) into an
# existing environment, without the dependencies `pip install lmcache` would pull: cupy-cuda13x,
# cuda-python, cufile-python, nvtx, a CUDA torch, and pins that would move the project's own packages
# (protobuf<7, grpcio-observability==1.78.0, prometheus_client<=0.24.1, numpy<=2.2.6).
#
#   scripts/install_lmcache_cpu.sh                      # the project's .venv
#   scripts/install_lmcache_cpu.sh /path/to/venv        # a virtual environment
#   scripts/install_lmcache_cpu.sh "python3 -m pip"     # any pip command
#
# Steps (each is a no-op when already done, so the script can run on every CI job):
#   1. torch 2.13.0 (the CPU build) if torch is missing ($TORCH_CPU, as in the Makefile);
#      another torch version already present is an error, never replaced;
#   2. lmcache==0.5.6 with --no-deps (its C++ extension wheel runs on CPU: StubCPUDevice);
#   3. the pure-Python packages (and CPU wheels) that importing its L2 adapter API, its SDK and
#      running `lmcache server` need, pinned: the same versions as requirements/vllm-cpu.txt where
#      that file names them, numba at vLLM 0.33.0's own pin, OpenTelemetry at the top of lmcache's
#      ranges;
#   4. checks: grpcio, protobuf and torch unchanged, no nvidia-* / cupy / triton package, and the
#      imports `lmcache server` makes (and the adapter, where the project is installed).
# What stays unmet on purpose (`pip check` lists it): protobuf<7 and grpcio-observability are for
# lmcache's gRPC transport and gRPC metrics (the server's default transport is ZMQ; its gRPC metrics
# are skipped with a warning without the package), opentelemetry-exporter-otlp only for
# --otlp-endpoint; prometheus_client<=0.24.1, numpy<=2.2.6 and setuptools<81 are upper bounds the
# code paths used here do not need; cupy, cuda-python, cufile-python and nvtx are CUDA; httptools,
# aiofile(s), awscrt, redis, google-cloud-bigtable, transformers and pytest serve other adapters,
# engines and lmcache's own tests.
# It never installs the project itself (make install-test does) and leaves its packages alone.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
TARGET=${1:-$ROOT/.venv}
TORCH_CPU=${TORCH_CPU:-torch==2.13.0}
LMCACHE_VERSION=0.5.6
REQUIREMENTS=(
  "numba==0.65.0"  # lmcache's CPU device ops; vllm==0.33.0 pins the same (llvmlite 0.47.0)
  "opentelemetry-api==1.40.0" "opentelemetry-sdk==1.40.0" "opentelemetry-exporter-prometheus==0.61b0"
  "httpx==0.28.1" "uvicorn==0.54.0" "sortedcontainers==2.4.0" "cryptography==50.0.2"
  # the same pins as requirements/vllm-cpu.txt
  "aiohttp==3.14.5" "blake3==1.0.11" "cachetools==8.0.2" "fastapi==0.136.3" "msgspec==0.23.0"
  "numpy==2.4.6" "prometheus_client==0.26.0" "psutil==7.2.2" "py-cpuinfo==9.0.0" "PyYAML==6.0.4"
  "pyzmq==27.3.0" "requests==2.34.2"
)

NAME=install_lmcache_cpu
# shellcheck source=scripts/pip_target.sh
. "$ROOT/scripts/pip_target.sh"  # PYTHON, PIP, pip, installed_version

torch_version=$(installed_version torch)
if [ -z "$torch_version" ]; then
  echo "install_lmcache_cpu: installing $TORCH_CPU"
  pip install --quiet "$TORCH_CPU"
  torch_version=$(installed_version torch)
fi
case "$torch_version" in
  2.13.0 | 2.13.0+cpu) ;;
  *) echo "install_lmcache_cpu: found torch $torch_version; the CPU tests need torch 2.13.0 (CPU build)" >&2; exit 1 ;;
esac
grpcio_version=$(installed_version grpcio)
protobuf_version=$(installed_version protobuf)

if [ "$(installed_version lmcache)" != "$LMCACHE_VERSION" ]; then
  echo "install_lmcache_cpu: installing lmcache==$LMCACHE_VERSION without its dependencies"
  pip install --quiet --no-deps "lmcache==$LMCACHE_VERSION"
fi
echo "install_lmcache_cpu: installing lmcache's CPU requirements (pip then lists lmcache's CUDA and gRPC pins as unmet: expected)"
pip install --quiet "${REQUIREMENTS[@]}"

leaked=$(pip list 2>/dev/null | grep -iE '^(nvidia|triton|cupy|cuda-python|cufile)' || true)
if [ -n "$leaked" ]; then
  echo "install_lmcache_cpu: CUDA packages got in:" >&2
  echo "$leaked" >&2
  exit 1
fi
for pkg in torch:"$torch_version" grpcio:"$grpcio_version" protobuf:"$protobuf_version"; do
  name=${pkg%%:*} before=${pkg#*:}
  if [ "$(installed_version "$name")" != "$before" ]; then
    echo "install_lmcache_cpu: $name changed from ${before:-none} to $(installed_version "$name")" >&2
    exit 1
  fi
done
LMCACHE_DISABLE_BANNER=1 LMCACHE_TRACK_USAGE=false LMCACHE_LOG_LEVEL=WARNING "$PYTHON" - <<'EOF'
import importlib.util

import lmcache
from lmcache.lmcache_native import Bitmap  # noqa: F401  the adapter's result type
from lmcache.sdk.context import LMCacheSDKContext  # noqa: F401  the client tests/lmcache drive the server with
from lmcache.v1.distributed.l2_adapters import plugin_l2_adapter  # noqa: F401  "type": "plugin"
from lmcache.v1.distributed.l2_adapters.base import L2AdapterInterface  # noqa: F401
from lmcache.v1.multiprocess.http_server import run_http_server  # noqa: F401  what `lmcache server` runs

if not hasattr(lmcache, "device_ops"):
    raise SystemExit("install_lmcache_cpu: lmcache loaded no compute backend (numba or torch missing)")
if importlib.util.find_spec("kvcache_connectors") is not None:
    import kvcache_connectors.lmcache_l2  # noqa: F401
EOF
echo "install_lmcache_cpu: lmcache $LMCACHE_VERSION with torch $torch_version (CPU) is ready in ${PIP[*]}"
