# Two commands set everything up on a fresh machine:
#   make run    create .venv, install, run the whole pipeline (dvc repro)
#   make test   install if needed, run the test suite
#
# CPU machines get the pinned CPU torch wheel through constraints.txt. GPU users:
# install the CUDA torch you want into .venv first, then `make install
# CONSTRAINTS=constraints-gpu.txt` (same pins, torch left free).

PYTHON      ?= python3
VENV        ?= .venv
CONSTRAINTS ?= constraints.txt
BIN         := $(VENV)/bin
STAMP       := $(VENV)/.installed
PYTEST_ARGS ?=
MLFLOW_PORT ?= 5000
PREFECT_PORT ?= 4200

export PATH := $(abspath $(BIN)):$(PATH)
export PYTHONUNBUFFERED := 1

.PHONY: help install run repro test test-fast bench mlflow clean-outputs lint

help:
	@echo "make run      install and run the whole pipeline on the embedded default corpus"
	@echo "make test     install and run the tests"
	@echo "make bench    run the benchmarks in bench/ (prints side-by-side ratios)"
	@echo "make mlflow   MLflow UI on http://127.0.0.1:$(MLFLOW_PORT)"

install: $(STAMP)

$(STAMP): pyproject.toml $(CONSTRAINTS)
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -c $(CONSTRAINTS) -e '.[dev]'
	touch $(STAMP)

run: install
	$(BIN)/dvc repro

repro: run

test: install
	$(BIN)/python -m pytest $(PYTEST_ARGS)

test-fast: install
	$(BIN)/python -m pytest -m "not slow" $(PYTEST_ARGS)

bench: install
	$(BIN)/python -m bench.data

mlflow: install
	MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false $(BIN)/mlflow server \
	  --backend-store-uri sqlite:///$(abspath mlflow.db) \
	  --artifacts-destination $(abspath mlartifacts) \
	  --host 127.0.0.1 --port $(MLFLOW_PORT) --workers 1

lint: install
	$(BIN)/hadolint Dockerfile
