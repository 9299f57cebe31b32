#!/usr/bin/env bash
# Installs sglang==0.5.23 for CPU-only use (tests/sglang: the HiCache storage backend) into an
# existing environment, without the CUDA stack that `pip install sglang` would pull (torch 2.14.1
# CUDA, flashinfer, sglang-kernel, triton, nvidia-*: several GB).
#
#   scripts/install_sglang_cpu.sh                      # the project's .venv
#   scripts/install_sglang_cpu.sh /path/to/venv        # a virtual environment
#   scripts/install_sglang_cpu.sh "python3 -m pip"     # any pip command
#
# Steps (each is a no-op when already done, so the script can run on every CI job):
#   1. torch 2.13.0 (the CPU build) must be there already (make install-test installs it first);
#      another torch version is an error, never replaced;
#   2. sglang==0.5.23 with --no-deps;
#   3. the few packages, pinned, that sglang's mem_cache modules import beyond what the project
#      and scripts/install_vllm_cpu.sh already install (numpy, msgspec, transformers, pyzmq, ...),
#      all with --no-deps: orjson, sentencepiece (sglang's own pin), compressed-tensors (sglang's
#      pin), gguf, dill, loguru, ipython and traitlets (sglang/utils.py imports IPython.display);
#   4. checks: no nvidia-* or triton package got in, torch and grpcio/protobuf unchanged, and
#      sglang's HiCacheStorage, its dynamic backend factory, the MHA and MLA host pools and the
#      kvcache backend import (through tests/sglang/cpu_shim.py, which stands in for Triton and
#      torchvision: neither has a CPU build that fits torch 2.13.0+cpu, and no kernel of theirs
#      runs on the storage path).
# It never installs the project itself (make install-test does) and leaves its packages alone.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
TARGET=${1:-$ROOT/.venv}
SGLANG_VERSION=0.5.23
DEPS=(
  orjson==3.13.0
  sentencepiece==0.2.1
  compressed-tensors==0.18.0
  gguf==0.19.0
  dill==0.4.1
  loguru==0.7.3
  ipython==9.18.1
  traitlets==5.16.1
)

NAME=install_sglang_cpu
# shellcheck source=scripts/pip_target.sh
. "$ROOT/scripts/pip_target.sh"  # PYTHON, PIP, pip, installed_version

torch_version=$(installed_version torch)
case "$torch_version" in
  2.13.0 | 2.13.0+cpu) ;;
  "") echo "install_sglang_cpu: torch is missing; install torch==2.13.0 (the CPU build) first" >&2; exit 1 ;;
  *) echo "install_sglang_cpu: found torch $torch_version; the CPU tests need torch 2.13.0 (CPU build)" >&2; exit 1 ;;
esac
grpcio_version=$(installed_version grpcio)
protobuf_version=$(installed_version protobuf)

if [ "$(installed_version sglang)" != "$SGLANG_VERSION" ]; then
  echo "install_sglang_cpu: installing sglang==$SGLANG_VERSION without its dependencies"
  pip install --quiet --no-deps "sglang==$SGLANG_VERSION"
fi
pip install --quiet --no-deps "${DEPS[@]}"

leaked=$(pip list 2>/dev/null | grep -iE '^(nvidia|triton)' || true)
if [ -n "$leaked" ]; then
  echo "install_sglang_cpu: CUDA packages got in:" >&2
  echo "$leaked" >&2
  exit 1
fi
for pkg in torch:"$torch_version" grpcio:"$grpcio_version" protobuf:"$protobuf_version"; do
  name=${pkg%%:*}
  before=${pkg#*:}
  if [ "$(installed_version "$name")" != "$before" ]; then
    echo "install_sglang_cpu: $name changed from $before to $(installed_version "$name")" >&2
    exit 1
  fi
done
(cd "$ROOT" && "$PYTHON" - <<'EOF'
import importlib.util
from tests.sglang.cpu_shim import install
install()
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig  # noqa: F401
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory  # noqa: F401
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost  # noqa: F401
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost  # noqa: F401
if importlib.util.find_spec("kvcache_connectors") is not None:
    import kvcache_connectors.sglang_hicache  # noqa: F401
EOF
)
echo "install_sglang_cpu: sglang $SGLANG_VERSION with torch $torch_version (CPU) is ready in ${PIP[*]}"
