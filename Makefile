# The front door: every target is one line of help (`make help`) and one script.
# Variables a user may set (defaults in ?= below; README lists them all):
# the Python the virtualenv is made from
PYTHON          ?= python3.11
# cached virtualenvs and the Horovod wheel
DLC_CACHE       ?= $(HOME)/.cache/dlcluster
# Ray token (0600), ray-client.env, cluster state
DLC_CONFIG      ?= $(HOME)/.config/dlcluster
# nodes of the embedded local cluster
NODES           ?= 2
# CPUs each local node offers; 0: cores / NODES
CPUS_PER_NODE   ?= 0
# object store per local node
OBJECT_STORE_MB ?= 512
# GCS port of the local head
RAY_PORT        ?= 6379
# dashboard + job API (127.0.0.1 only)
DASHBOARD_PORT  ?= 8265
# job that `make submit` runs (jobs/$(JOB).py)
JOB             ?= ddp_autoencoder
# extra flags for that job
ARGS            ?=
# extra flags for pytest
PYTEST_ARGS     ?=

export PYTHON DLC_CACHE DLC_CONFIG NODES CPUS_PER_NODE OBJECT_STORE_MB RAY_PORT DASHBOARD_PORT
VENV := .venv
PY   := $(VENV)/bin/python
SUBMIT = . $(DLC_CONFIG)/ray-client.env && $(VENV)/bin/ray job submit \
         --address http://127.0.0.1:$(DASHBOARD_PORT) --working-dir .

.DEFAULT_GOAL := help
.PHONY: help setup cluster-up cluster-status cluster-down submit demo test test-unit \
        test-cluster lint bench-ae clean

help: ## list the targets
	@awk 'BEGIN{FS=":.*## "} /^[a-z-]+:.*## /{printf "  %-16s %s\n", $$1, $$2}' $(MAKEFILE_LIST)

setup: ## make the pinned virtualenv (.venv; cached, seconds when nothing changed)
	@scripts/setup.sh

cluster-up: setup ## start the local Ray cluster: a head + NODES-1 workers, token auth on
	@$(PY) ray/local_cluster.py up

cluster-status: setup ## nodes and resources of the running cluster
	@$(PY) ray/local_cluster.py status

cluster-down: setup ## stop only the processes cluster-up started
	@$(PY) ray/local_cluster.py down

submit: setup ## submit jobs/$(JOB).py $(ARGS) to the running cluster (ray job submit)
	@$(SUBMIT) -- python jobs/$(JOB).py $(ARGS)

demo: cluster-up ## setup, cluster-up, then train the autoencoder and print where the ONNX model landed
	@$(SUBMIT) -- python jobs/ddp_autoencoder.py $(ARGS)

test: lint test-unit test-cluster ## every test tier (lint, unit, local cluster)

test-unit: setup ## unit tests: models, data, ONNX parity, errors (no cluster)
	@$(PY) -m pytest tests/unit $(PYTEST_ARGS)

test-cluster: setup ## jobs end to end on a throwaway local 2-node cluster via ray job submit
	@$(PY) -m pytest tests/cluster $(PYTEST_ARGS)

lint: setup ## ruff over the Python code
	@$(VENV)/bin/ruff check .

bench-ae: setup ## the tutorial's table: workers 1,2 x batch 64,128 on the running cluster
	@. $(DLC_CONFIG)/ray-client.env && $(PY) tests/bench/bench_autoencoder.py $(ARGS)

clean: ## remove the .venv link (the cached environment stays in DLC_CACHE)
	rm -f $(VENV)
