# The two commands of the README: `make demo` (the main job) and `make test`. Both create the virtualenv.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
export HF_HUB_OFFLINE ?= 1
export HF_DATASETS_OFFLINE ?= 1
export MPLBACKEND ?= Agg

.PHONY: venv demo test test-fast lint mlflow-server

# torch is pinned through constraints.txt (a CPU wheel here; a GPU user installs a CUDA build first, see README).
# hydra-optuna-sweeper declares optuna<3, which breaks RDB storages: it is installed without its dependencies.
# fschat (FastChat: the MT-Bench tests run its loaders and result code on the suite's files) pins a serving stack
# the suite does not need: it is installed without its dependencies too.
$(STAMP): pyproject.toml constraints.txt
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt -e '.[dev]'
	$(PY) -m pip install -q --no-deps hydra-optuna-sweeper==1.3.0
	$(PY) -m pip install -q --no-deps fschat==0.2.36
	touch $(STAMP)

venv: $(STAMP)

demo: venv
	$(VENV)/bin/flowlm-demo

# The suite runs on TEST_WORKERS processes (pytest-xdist; every core, at most 8), a test file to one worker so that
# its module fixtures are built once; `make test TEST_WORKERS=0` runs it in this process alone.
TEST_WORKERS ?= $(shell n=$$(nproc 2>/dev/null || echo 1); echo $$(( n < 8 ? n : 8 )))
XDIST = $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile)

test: venv
	$(PY) -m pytest -q $(XDIST)

test-fast: venv
	$(PY) -m pytest -q $(XDIST) -m "not slow"

# An MLflow tracking server that several workers log to (`logger=mlflow_server logger.tracking_uri=http://host:5000`);
# settings as environment variables, e.g. `make mlflow-server MLFLOW_HOST=0.0.0.0 MLFLOW_PORT=5001` (see the script).
mlflow-server: venv
	MLFLOW=$(VENV)/bin/mlflow bash scripts/mlflow_server.sh

lint: venv
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check . && $(VENV)/bin/lint-imports
