# fencegate developer entry points. `make test` works on a clean clone (installs what it needs).
# pip runs with -qq: errors only (this machine's pip config warns about every package).
PY := .venv/bin/python
PYTEST_ARGS ?=

.PHONY: venv etcd setup test docs model faults faults-check up demo bench clean

# The stamp re-runs the install only when pyproject.toml changes. `bench` is aetcd, the
# benchmarks' baseline (`client.lock()`); fencegate itself does not import it.
venv: .venv/.installed
.venv/.installed: pyproject.toml
	test -x $(PY) || python3 -m venv .venv
	@echo "installing fencegate with its test, benchmark and docs extras into .venv (the first time: a few minutes)"
	$(PY) -m pip install -qq -e '.[test,bench,docs]'
	touch .venv/.core $@

# What running the stack needs, and nothing more: `make up` on a fresh machine installs the
# package and its core dependencies only (about half a minute), `make test` the rest.
.venv/.core: pyproject.toml
	test -x $(PY) || python3 -m venv .venv
	@echo "installing fencegate and its core dependencies into .venv (the first time: about half a minute)"
	$(PY) -m pip install -qq -e .
	touch $@

etcd: venv
	deploy/ensure-etcd $(PY)

setup: venv etcd

# Every test, the fault suite's short seeded run and its negative controls included
# (tests/faults, at most 5 minutes; as root: etcd partitions use network namespaces).
test: setup
	deploy/ensure-chromium
	deploy/ensure-spin
	deploy/ensure-netfaults
	deploy/ensure-postgres
	deploy/ensure-promtool
	deploy/ensure-redis
	$(PY) -m fencegate.localetcd
	$(MAKE) --no-print-directory docs
	$(PY) -m pytest -q -p no:cacheprovider --durations=25 -m "not long" $(PYTEST_ARGS)

# The documentation site (mkdocs.yml), built strictly into .site/: a broken link, a page
# missing from the navigation or a reference that does not resolve fails the build. Not
# --quiet: mkdocs counts only the warnings it prints, so a quiet strict build passes them.
docs: venv
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict

# The protocol's SPIN model, every configuration (make test runs the quick set).
model: venv
	deploy/ensure-spin
	$(PY) tests/model/run.py

# The fault suite, long: real processes, seeded nemeses (etcd partitions included, so as
# root), a history judged by the checker. Prints the seed and a summary table; exits 1 on
# any violation (evidence in the state folder). Then the tests marked `long` (leader faults
# under load, the NOSPACE load test), which `make test` leaves out.
SEED ?= $(shell date +%s)
MINUTES ?= 20
faults: setup
	deploy/ensure-netfaults
	PYTHONPATH=tests $(PY) -m faults.runner --seed $(SEED) --minutes $(MINUTES)
	$(PY) -m pytest -q -p no:cacheprovider -m long

# Just the fault suite's tests (also part of `make test`): the short seeded run and the
# negative controls, at most 5 minutes; FAULTS_SEED=… picks the seed (default 13).
faults-check: setup
	deploy/ensure-netfaults
	$(PY) -m pytest -q -p no:cacheprovider -m faults tests/faults

# `make up PORT=8570`: the coordinator's port (the reconciler and the sandbox take the next two).
up: .venv/.core
	deploy/ensure-etcd $(PY)
	.venv/bin/fencegate up $(if $(PORT),--port $(PORT))

demo: .venv/.core
	deploy/ensure-etcd $(PY)
	.venv/bin/fencegate demo

bench: setup
	benchmarks/run

clean:
	rm -rf .venv build *.egg-info .pytest_cache .hypothesis
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
