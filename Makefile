# make run   -> set up .venv on first use, then: python -m expgpu task=a gpu_map=ranked
# make test  -> set up .venv on first use, then: make docs, the whole test suite (.ci/run runs this)
# make check -> ruff, then the fast tier: every module's logic in this process, no ranks, sweeps or SLURM
# make check-gpu-node -> the fast tier as if this machine had one GPU (NVML's answers only): a test that would
#               put a job on a GPU node's GPU fails here (this torch has no CUDA); no GPU needed
# make docs  -> the documentation site (mkdocs.yml, docs/) into site/, --strict: a broken link fails
# make lint  -> ruff (lint + import order, 120 columns): also the first step of make test and make check
# Extra arguments: make run ARGS="launch.nproc_per_node=2"   make test ARGS="-k ranks"
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.expgpu-setup
# The suite's tests in this many processes (pytest-xdist). The SLURM tests, one group (conftest),
# mostly wait on the cluster: one worker waits through them while two keep 2 cores busy with the
# rest. TEST_WORKERS=0: one process. loadgroup: the tests of a module marked xdist_group share one
# worker, and so its expensive module-scoped fixture (an uninterrupted reference run, a real sweep).
TEST_WORKERS ?= 3

.PHONY: run test check check-gpu-node lint docs setup bench slurm-up slurm-down
run: $(STAMP)
	$(PY) -m expgpu task=a gpu_map=ranked $(ARGS)

test: lint docs
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadgroup $(ARGS)

check: lint
	$(PY) -m pytest -q -m "not slow and not slurm and not gpu" $(ARGS)

check-gpu-node: $(STAMP)
	PYTHONPATH=tests/helpers/one_gpu_nvml$${PYTHONPATH:+:$$PYTHONPATH} \
		$(PY) -m pytest -q -rfE -m "not slow and not slurm and not gpu" $(ARGS)

# Not --quiet: it hides the warnings that --strict counts (a broken link would pass). NO_MKDOCS_2_WARNING:
# material's notice about its end of life, once a build, is no finding of ours.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict

lint: $(STAMP)
	$(PY) -m ruff check src tests bench examples scripts

bench: $(STAMP)
	$(PY) bench/bench_ddp_overhead.py $(ARGS)

setup: $(STAMP)

$(STAMP): pyproject.toml scripts/setup-env.sh
	bash scripts/setup-env.sh $(VENV)

# A one-node SLURM cluster on this machine (root, Debian): scripts/slurm-local/README.md
slurm-up:
	bash scripts/slurm-local/start.sh
	@echo "now: export SLURM_CONF=/tmp/expgpu-slurm/slurm.conf"

slurm-down:
	bash scripts/slurm-local/stop.sh
