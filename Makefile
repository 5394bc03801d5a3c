# Two commands set everything up on a fresh machine:
#   make run    create .venv, install, run the whole pipeline (dvc repro)
#   make test   install if needed, run the test suite
#
# CPU machines get the pinned CPU torch wheel through constraints.txt. GPU users:
# install the CUDA torch you want into .venv first, then `make install
# KEEP_TORCH=1` (same pins, except that the torch already there is kept).

PYTHON      ?= python3
VENV        ?= .venv
CONSTRAINTS ?= constraints.txt
KEEP_TORCH  ?= 0
BIN         := $(VENV)/bin
STAMP       := $(VENV)/.installed
PYTEST_ARGS ?=
# Test processes (pytest-xdist). Most slow tests wait on subprocesses, servers
# and a cron tick, so two share a 2-core machine well; a test file stays on one
# process (its module fixtures are built once). TEST_WORKERS=0: one process.
TEST_WORKERS ?= 2
PYTEST      := $(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder
MLFLOW_PORT ?= 5000
PREFECT_PORT ?= 4200

export PATH := $(abspath $(BIN)):$(PATH)
export PYTHONUNBUFFERED := 1

.PHONY: help install run repro test test-fast bench memory mlflow clean-outputs lint

help:
	@echo "make run             install and run the whole pipeline on the embedded default corpus"
	@echo "make test            install and run the tests (make test-fast skips the slow ones)"
	@echo "make bench           benchmarks in bench/ (print side-by-side ratios)"
	@echo "make memory          memory per GPU of every preset (SEQ_LEN=1024 GPUS=8)"
	@echo "make mlflow          MLflow UI on http://127.0.0.1:$(MLFLOW_PORT)"
	@echo "make flow            the pipeline as a Prefect flow (temporary local server)"
	@echo "make prefect-server  a real Prefect server/UI on http://127.0.0.1:$(PREFECT_PORT)"
	@echo "make retrain         serve scheduled retraining (CRON='0 3 * * *') against it"
	@echo "make screenshot      docs/mlflow-compare.png from mlflow.db"
	@echo "make docker-build    the container image (BASE_IMAGE=python:3.11-slim for CPU)"

install: $(STAMP)

$(STAMP): pyproject.toml $(CONSTRAINTS)
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	if [ "$(KEEP_TORCH)" = 1 ]; then grep -v '^torch' $(CONSTRAINTS) > $(VENV)/constraints.txt; \
	  else cp $(CONSTRAINTS) $(VENV)/constraints.txt; fi
	$(BIN)/python -m pip install --quiet -c $(VENV)/constraints.txt -e '.[dev]'
	touch $(STAMP)

run: install
	$(BIN)/dvc repro

repro: run

test: install
	$(PYTEST) $(PYTEST_ARGS)

test-fast: install
	$(PYTEST) -m "not slow" $(PYTEST_ARGS)

bench: install
	$(BIN)/python -m bench.data
	$(BIN)/python -m bench.ray_data
	$(BIN)/python -m bench.dedup_bucket
	$(BIN)/python -m bench.pack_resume
	$(BIN)/python -m bench.compressed
	$(BIN)/python -m bench.train
	$(BIN)/python -m bench.hf

memory: install
	$(BIN)/python -m pipeline.training.memory --seq-len $(or $(SEQ_LEN),1024) --gpus $(or $(GPUS),8)

mlflow: install
	MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false $(BIN)/mlflow server \
	  --backend-store-uri sqlite:///$(abspath mlflow.db) \
	  --artifacts-destination $(abspath mlartifacts) \
	  --host 127.0.0.1 --port $(MLFLOW_PORT) --workers 1

lint: install
	$(BIN)/hadolint Dockerfile

# --- orchestration, screenshots and the container (flows/, scripts/, Dockerfile)
# Prefect state (server database, temporary-server database) lives in .prefect/.
PREFECT_HOME ?= $(abspath .prefect)
PREFECT_API  ?= http://127.0.0.1:$(PREFECT_PORT)/api
CRON         ?=
FLOW_ARGS    ?=
RETRAIN_ARGS ?=
IMAGE        ?= llm-pipeline
BASE_IMAGE   ?=

.PHONY: prefect-server flow retrain screenshot docker-build

# A real Prefect server (UI on http://127.0.0.1:$(PREFECT_PORT)); schedules need one.
prefect-server: install
	PREFECT_HOME=$(PREFECT_HOME) PREFECT_SERVER_ANALYTICS_ENABLED=false \
	  $(BIN)/prefect server start --host 127.0.0.1 --port $(PREFECT_PORT)

# The pipeline once, as a Prefect flow on a temporary local server.
flow: install
	PREFECT_HOME=$(PREFECT_HOME) $(BIN)/python -m flows.pipeline $(FLOW_ARGS)

# Serve scheduled retraining against `make prefect-server` (CRON="0 3 * * *" by default).
retrain: install
	PREFECT_HOME=$(PREFECT_HOME) PREFECT_API_URL=$(PREFECT_API) \
	  $(BIN)/python -m flows.retrain $(if $(CRON),--cron "$(CRON)") $(RETRAIN_ARGS)

# docs/mlflow-compare.png from mlflow.db (demo runs if it has fewer than two pipeline runs).
screenshot: install
	$(BIN)/python scripts/mlflow_screenshot.py

# GPU image by default; BASE_IMAGE=python:3.11-slim gives the CPU image.
docker-build:
	docker build -t $(IMAGE) $(if $(BASE_IMAGE),--build-arg BASE_IMAGE=$(BASE_IMAGE)) \
	  $(if $(APP_UID),--build-arg APP_UID=$(APP_UID)) $(if $(EXTRAS),--build-arg EXTRAS=$(EXTRAS)) \
	  --build-arg GIT_COMMIT=$$(git rev-parse HEAD) .
