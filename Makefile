# The front door: every target is one line of help (`make help`) and one script; the operator's
# targets call one installed command, `.venv/bin/dlcluster <command>` (dlcluster/cli.py; --help on
# each), whose flags default to the variables below (exported).
# Variables a user may set (defaults in ?= below; README lists them all). Versions and default
# paths are versions.env's, the one place for each.
include versions.env
# the Python the virtualenv is made from
PYTHON          ?= $(DEFAULT_PYTHON)
# cached virtualenvs and the Horovod wheel
DLC_CACHE       ?= $(HOME)/$(DEFAULT_CACHE_IN_HOME)
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
# an Ansible cluster's Prometheus, at this port of 127.0.0.1 (the tunnel's other forward)
METRICS_PORT    ?= 9090
# an Ansible cluster's Grafana, at this port of 127.0.0.1 (the same tunnel; each end its own port)
GRAFANA_PORT    ?= 3000
# the local cluster's MLflow tracking server (127.0.0.1 only); an Ansible cluster's, this tunnel end
TRACKING_PORT   ?= 5000
# job that `make submit` runs (jobs/$(JOB).py)
JOB             ?= ddp_autoencoder
# extra flags for that job
ARGS            ?=
# files or folders of the checkout that `make submit` uploads beside the ones git tracks
UPLOAD          ?=
# the run that `make resume` submits again (a --name that `make submit` submitted from here)
RUN             ?=
# extra flags for pytest
PYTEST_ARGS     ?=
# the unit tier's test processes (pytest-xdist): auto = one per core, at most 4; 0: in pytest's own
UNIT_PROCS      ?= auto
# make test's lanes, side by side (space-separated; tiers in a lane, comma-separated, run in turn;
# `then` starts the lanes after it once every lane before it has ended)
TEST_LANES      ?= lint,unit,gpu,cluster,image emulated
# servers to provision through their bastion (ansible/inventories/<name>/hosts.yml); empty: the local cluster
INVENTORY       ?=
# extra flags for ansible-playbook (e.g. --limit node-2, -v)
ANSIBLE_ARGS    ?=
# extra flags for make smoke (dlcluster smoke --help), e.g. --only nodes,allreduce --max-mib 64
SMOKE_ARGS      ?=
# extra flags for make doctor (dlcluster doctor --help), e.g. --min-free-gb 10
DOCTOR_ARGS     ?=
# make doctor QUARANTINE=1: take each worker with a finding out of Ray; make unquarantine NODE=...: back;
# make remove-node NODE=...: the worker taken out of the cluster
QUARANTINE      ?=
NODE            ?=

# Tokens, keys and inventories' ssh configs live in DLC_CONFIG: never inside the checkout, whose
# files travel with every job (ray job submit --working-dir .).
ifneq ($(filter $(CURDIR)/%,$(abspath $(DLC_CONFIG))/),)
$(error DLC_CONFIG=$(DLC_CONFIG) is inside the checkout $(CURDIR), whose files travel with every job; set it outside, e.g. DLC_CONFIG=$(HOME)/.config/dlcluster)
endif

export PYTHON DLC_CACHE DLC_CONFIG NODES CPUS_PER_NODE OBJECT_STORE_MB RAY_PORT DASHBOARD_PORT METRICS_PORT GRAFANA_PORT TRACKING_PORT \
       INVENTORY ANSIBLE_ARGS PYTEST_ARGS UPLOAD RUN
VENV := .venv
PY   := $(VENV)/bin/python
DLC  := $(VENV)/bin/dlcluster

.DEFAULT_GOAL := help
.PHONY: help setup lock cluster-up cluster-status token grafana-password tracking-password runs users jobs logs audit cluster-down attach rotate-token remove-node upgrade submit resume demo test leftovers check test-unit \
        test-cluster test-gpu stage-gpu lint bench bench-ae bench-gateway bench-queue clean smoke baseline doctor unquarantine emulate-up emulate-down emulate-purge emulate-status test-emulated

help: ## list the targets
	@awk 'BEGIN{FS=":.*## "} /^[a-z-]+:.*## /{printf "  %-16s %s\n", $$1, $$2}' $(MAKEFILE_LIST)

setup: ## make the virtualenv from requirements.lock, hashes checked (.venv; cached, seconds when nothing changed)
	@scripts/setup.sh

lock: ## after changing a pin in pyproject.toml: requirements.lock and docker/tf-cuda.lock, with hashes (uv)
	@scripts/lock.sh

cluster-up: setup ## INVENTORY set: provision its servers through the bastion, start Ray, open the tunnel; else a local cluster
	@$(DLC) up

cluster-status: setup ## each node's Ray service and the nodes and resources the head sees
	@$(DLC) status

token: setup ## print the current cluster's Ray token, for the dashboard's sign-in dialog (to the terminal only)
	@$(DLC) token

grafana-password: setup ## print the current cluster's Grafana admin password, for its sign-in page (to the terminal only)
	@$(DLC) grafana-password

tracking-password: setup ## print the run history's URL, user and password, for its sign-in (to the terminal only)
	@$(DLC) tracking-password

runs: setup ## the last runs from the cluster's MLflow server (run, job, commit, epochs, validation, restarts, model, state); RUN=name: its metrics per epoch
	@$(DLC) runs $(if $(RUN),--run $(RUN))

users: setup ## admins: the cluster's people (ARGS="add NAME --team T [--admin] [--expires 90d]" or "revoke NAME"; default: list)
	@$(DLC) user $(or $(ARGS),list)

jobs: setup ## every job the cluster's gateway keeps, with its owner, team, state and run (also from before a head restart)
	@$(DLC) jobs

logs: setup ## job $(ID)'s driver log as the cluster's gateway kept it (also after a head restart)
	@$(DLC) logs $(ID)

audit: setup ## the cluster's audit trail (who submitted, stopped, deleted, was refused, added or revoked whom) and whether its chain holds
	@$(DLC) audit

cluster-down: setup ## stop Ray (workers, then head) and close the tunnel; data, images, packages stay
	@$(DLC) down

attach: setup ## INVENTORY set: use a running cluster from this machine (its token from the head, record, tunnel); changes no server
	@$(DLC) attach

rotate-token: setup ## INVENTORY set: a new Ray token on every node and here, Ray restarted with it (no job running)
	@$(DLC) rotate-token

remove-node: setup ## INVENTORY set: take worker NODE out (drained, its Ray stopped, out of every list and the record; the cluster re-keyed)
	@$(DLC) remove-node $(NODE)

upgrade: setup ## INVENTORY set: roll a new image, environment or setting onto the running cluster, one worker at a time (drained, restarted, checked, rolled back on failure), the head last
	@SMOKE_ARGS="$(SMOKE_ARGS)" $(DLC) upgrade

submit: setup ## submit jobs/$(JOB).py $(ARGS) to the running cluster (ray job submit), uploading only what git tracks and $(UPLOAD)
	@$(DLC) submit $(JOB) $(ARGS)

resume: setup ## submit run $(RUN) again, as `make submit` first did (same job, flags, --name), to go on from its last checkpoint after its driver was lost
	@$(DLC) resume $(RUN)

demo: cluster-up ## setup, cluster-up, then train the autoencoder and print where the ONNX model landed
	@$(DLC) submit ddp_autoencoder $(ARGS)

test: ## every tier in two lanes side by side (TEST_LANES: lint, unit, GPU, local cluster, image; beside the emulated tier), what they left behind, a table, then `N passed, N failed, N skipped`
	@scripts/test.sh --reports $(DLC_CACHE)/test-reports --state $(DLC_CACHE)/test-state $(TEST_LANES)

leftovers: setup ## what the test tiers left on this machine (ports, state files, processes, the image and emulated tiers' containers and rules, files in the checkout); exit 1 if anything
	@$(PY) scripts/leftovers.py --state $(DLC_CACHE)/test-state

check: setup ## lint and the unit tier, with the same table and closing line (minutes; no root, no images)
	@$(PY) scripts/test_suite.py --reports $(DLC_CACHE)/test-reports lint,unit

test-unit: setup ## unit tests: models, data, ONNX parity, errors (no cluster)
	@$(PY) -m pytest tests/unit -n $(UNIT_PROCS) --maxprocesses 4 $(PYTEST_ARGS)

test-cluster: setup ## jobs end to end on a throwaway local 2-node cluster via ray job submit
	@$(PY) -m pytest tests/cluster $(PYTEST_ARGS)

test-gpu: setup ## the GPU tier (tests/gpu): the jobs on CUDA, NCCL, Horovod's NCCL build, pipeline efficiency; skipped without CUDA
	@$(PY) -m pytest tests/gpu -rs $(PYTEST_ARGS)

stage-gpu: setup ## stage what a bare offline GPU machine lacks for the GPU tier into .gpu-stage (< 60 MiB; run there: scripts/gpu_tier.sh)
	@scripts/stage_gpu.sh

lint: setup ## ruff, mypy, shellcheck, yamllint, the roles' variable descriptions and ansible-lint (production profile)
	@scripts/lint.sh

smoke: setup ## multi-node smoke tests of the running cluster: nodes, all-reduce bandwidth, perf against the baseline, the four trainers, ProxyJump
	@$(DLC) smoke $(SMOKE_ARGS)

baseline: setup ## record the cluster's performance baseline (no job running): per node step time and storage, per link iperf3, all-reduce busbw
	@$(DLC) baseline $(SMOKE_ARGS)

doctor: setup ## every node of the running cluster checked at once and compared: versions, network, storage, clocks, Ray, firewall, GPUs; one line per problem (QUARANTINE=1: take bad workers out of Ray)
	@$(DLC) doctor $(if $(QUARANTINE),--quarantine) $(DOCTOR_ARGS)

unquarantine: setup ## put the quarantined node NODE back into Ray (its quarantine file removed, Ray started)
	@$(DLC) unquarantine $(NODE)

bench: setup ## Ray Train vs each job's own launcher side by side (current cluster): ratios, bench.json, bench.png
	@$(DLC) bench $(ARGS)

bench-ae: setup ## the tutorial's table: workers 1,2 x batch 64,128 on the current cluster (its record)
	@$(DLC) bench-ae $(ARGS)

bench-gateway: setup ## what the job gateway adds to each job API call and to a followed log, against Ray directly (a head and a gateway of its own, here)
	@$(DLC) bench-gateway $(ARGS)

bench-queue: setup ## the queue's policy (issue 71) over a month's trace of a 4-team, 8-GPU cluster in its simulator, beside FIFO: each team's GPU-hours against its due, waits, utilisation
	@$(DLC) bench-queue $(ARGS)

clean: ## remove the checkout's .venv (the cached environment it is made over stays in DLC_CACHE)
	rm -rf $(VENV)

# ---- container images (docker/; docs/images.md)
# 1: the CUDA image (NCCL operations) instead of the CPU one
GPU        ?= 0
# the tag; empty: dlcluster:cpu or dlcluster:gpu
IMAGE      ?=
# the FROM image; empty: versions.env's PIN_CPU_BASE_IMAGE (made here) or PIN_GPU_BASE_IMAGE
BASE_IMAGE ?=
# GPU: CUDA architectures for Horovod's NCCL operations (e.g. 80,90); empty: all 12
CUDA_ARCHS ?=
# CA bundle for the build's apt steps (BuildKit secret); empty: the host's when it trusts an extra CA; none
CA_BUNDLE  ?=
# 1: build even when the image there was built from the same inputs (its dlcluster.inputs label)
IMAGE_REBUILD ?= 0
export GPU IMAGE BASE_IMAGE CUDA_ARCHS CA_BUNDLE IMAGE_REBUILD
.PHONY: wheels image-base image test-image image-report

wheels: setup ## the wheelhouse of the lock's runtime part that image builds install from (no index)
	@scripts/wheelhouse.sh

image-base: ## a Debian base image with no registry: debootstrap + docker import (versions.env's PIN_CPU_BASE_IMAGE)
	@docker/mkbase.sh

image: setup ## build the image: CPU here by default, GPU=1 for the CUDA one (docker/Dockerfile)
	@docker/build.sh

test-image: setup ## the image tier: build the CPU image (layer cache reused), test inside it; compile the GPU Horovod
	@$(PY) -m pytest tests/container $(PYTEST_ARGS)

image-report: setup ## the image's size per layer group and its build times, cold and warm
	@$(DLC) image-report

# ---- the emulated cluster (tests/emulated/; docs/emulated.md)
emulate-up: image ## a bastion + 3 node containers behind it on a private network (then: make cluster-up INVENTORY=ansible/inventories/emulated/hosts.yml)
	@tests/emulated/emulate.sh up

emulate-down: ## remove the emulated cluster's containers, networks, shared volume and every iptables rule the tier adds (its data disks stay: images cached by content)
	@tests/emulated/emulate.sh down

emulate-purge: ## emulate-down, and the emulated servers' data disks (registry storage, node-3's Docker)
	@tests/emulated/emulate.sh purge

emulate-status: ## the emulated cluster's containers
	@tests/emulated/emulate.sh status

test-emulated: setup image ## emulate-up, cluster-up through the bastion, the README's job via the tunnel, smoke, idempotence, bad input, cluster-down
	@$(PY) -m pytest tests/emulated $(PYTEST_ARGS)
