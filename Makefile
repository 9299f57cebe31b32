# kvcache: the two commands a new machine needs, and a few for developers.
#   make serve   install the server and start it (RAM only, 127.0.0.1:51051)
#   make test    install everything the tests need and run the whole suite (what CI runs)

PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
PIP    := $(BIN)/python -m pip
# The CPU build of torch: installed before the project so nothing pulls a multi-GB CUDA build.
TORCH_CPU ?= torch==2.13.0

.PHONY: serve test lint proto bench install-server install-test system-deps clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip

install-server: $(BIN)/python
	$(PIP) install --quiet -e .

serve: install-server
	$(BIN)/kvcache-server $(ARGS)

system-deps:
	@{ command -v redis-server && command -v redis-cli && command -v promtool; } >/dev/null 2>&1 || { \
	  echo "installing redis-server, redis-cli and promtool (Debian packages; the Redis Cluster tests use the first two, tests/test_monitoring.py promtool)"; \
	  if [ "$$(id -u)" = 0 ]; then SUDO=; else SUDO=sudo; fi; \
	  $$SUDO apt-get update -qq && $$SUDO apt-get install -y -qq redis-server redis-tools prometheus >/dev/null; }

install-test: $(BIN)/python system-deps
	$(PIP) install --quiet "$(TORCH_CPU)"
	$(PIP) install --quiet -e ".[server,torch,transformers,test,dev]"
	# vllm==0.33.0 for tests/vllm, without its CUDA dependency tree (a no-op when already there)
	TORCH_CPU="$(TORCH_CPU)" scripts/install_vllm_cpu.sh $(VENV)
	# lmcache==0.5.6 for tests/lmcache (kvcache as LMCache's L2), without its CUDA dependencies
	TORCH_CPU="$(TORCH_CPU)" scripts/install_lmcache_cpu.sh $(VENV)
	# sglang==0.5.23 for tests/sglang (kvcache as SGLang's HiCache storage), without its CUDA dependencies
	scripts/install_sglang_cpu.sh $(VENV)

test: install-test
	$(BIN)/ruff check .
	$(BIN)/python -m pytest $(PYTEST_ARGS)

lint: $(BIN)/python
	$(BIN)/ruff check . && $(BIN)/ruff format --check .

proto: $(BIN)/python
	$(BIN)/python scripts/gen_proto.py

bench: install-test
	$(BIN)/python bench/bench_throughput.py $(ARGS)

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache .hypothesis
