#!/usr/bin/env bash
# Installs vllm==0.33.0 for CPU-only use (tests/vllm) into an existing environment, without the
# CUDA stack that `pip install vllm` would pull (torch 2.14.0 CUDA, nvidia-*, triton: several GB).
#
#   scripts/install_vllm_cpu.sh                      # the project's .venv
#   scripts/install_vllm_cpu.sh /path/to/venv        # a virtual environment
#   scripts/install_vllm_cpu.sh "python3 -m pip"     # any pip command
#
# Steps (each is a no-op when already done, so the script can run on every CI job):
#   1. torch 2.13.0 (the CPU build) if torch is missing ($TORCH_CPU, as in the Makefile);
#      another torch version already present is an error, never replaced;
#   2. vllm==0.33.0 with --no-deps;
#   3. requirements/vllm-cpu.txt: the pure-Python packages its imports need;
#   4. xgrammar==0.2.8 and apache-tvm-ffi with --no-deps (they declare torch and triton);
#   5. checks: no nvidia-* or triton package, torch still the CPU 2.13.0, vLLM's scheduler and the
#      connector import.
# It never installs the project itself (make install-test does) and leaves its packages alone.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
TARGET=${1:-$ROOT/.venv}
TORCH_CPU=${TORCH_CPU:-torch==2.13.0}
VLLM_VERSION=0.33.0
XGRAMMAR=xgrammar==0.2.8
TVM_FFI=apache-tvm-ffi==0.1.15.post2

NAME=install_vllm_cpu
# shellcheck source=scripts/pip_target.sh
. "$ROOT/scripts/pip_target.sh"  # PYTHON, PIP, pip, installed_version

torch_version=$(installed_version torch)
if [ -z "$torch_version" ]; then
  echo "install_vllm_cpu: installing $TORCH_CPU"
  pip install --quiet "$TORCH_CPU"
  torch_version=$(installed_version torch)
fi
case "$torch_version" in
  2.13.0 | 2.13.0+cpu) ;;
  *) echo "install_vllm_cpu: found torch $torch_version; the CPU tests need torch 2.13.0 (CPU build)" >&2; exit 1 ;;
esac

if [ "$(installed_version vllm)" != "$VLLM_VERSION" ]; then
  echo "install_vllm_cpu: installing vllm==$VLLM_VERSION without its dependencies"
  pip install --quiet --no-deps "vllm==$VLLM_VERSION"
fi
echo "install_vllm_cpu: installing requirements/vllm-cpu.txt (pip then lists vLLM's CUDA dependencies as missing: expected)"
pip install --quiet -r "$ROOT/requirements/vllm-cpu.txt"
pip install --quiet --no-deps "$XGRAMMAR" "$TVM_FFI"

leaked=$(pip list 2>/dev/null | grep -iE '^(nvidia|triton)' || true)
if [ -n "$leaked" ]; then
  echo "install_vllm_cpu: CUDA packages got in:" >&2
  echo "$leaked" >&2
  exit 1
fi
if [ "$(installed_version torch)" != "$torch_version" ]; then
  echo "install_vllm_cpu: torch changed from $torch_version to $(installed_version torch)" >&2
  exit 1
fi
"$PYTHON" - <<'EOF'
import importlib.util
import vllm.v1.core.sched.scheduler  # noqa: F401  the scheduler the tests drive
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1  # noqa: F401
if importlib.util.find_spec("kvcache_connectors") is not None:
    import kvcache_connectors.vllm  # noqa: F401
EOF
echo "install_vllm_cpu: vllm $VLLM_VERSION with torch $torch_version (CPU) is ready in ${PIP[*]}"
