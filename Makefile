# Two commands are the contract (README): `make test` and `make demo`. Both set up everything
# from nothing (venv, torch, the pinned sdist, the patch series, the editable install) and are
# fast when nothing changed.
SHELL := /bin/bash
PYTHON ?= python3
# A second torch cell: TORCH=2.10.0 (the default preset of upstream's cpu-torch-latest CI,
# .github/workflows/cpu-torch-latest.yml) makes every target use .venv-torch2.10.0: requirements/dev-cpu.txt with
# torch==2.10.0 instead of its pin, from PyPI, or from TORCH_INDEX where set (an index URL, e.g. the CPU wheel index
# that workflow installs from, its PYTORCH_INDEX_URL). upstream-tests and branch-tests keep that cell's results
# apart (.cache/upstream-tests-torch2.10.0/, .cache/branch-tests-torch2.10.0/). Unset: .venv, the default cell.
TORCH ?=
TORCH_INDEX ?=
CELL := $(if $(TORCH),-torch$(TORCH))
VENV := .venv$(CELL)
VPY := $(VENV)/bin/python
PATCHES := tools/patches.py
# JIT-built ops (FusedAdam's CPU op, async_io) are cached inside the venv, one folder per DeepSpeed tree
# (tests/unit/env.py), so reruns are fast.
PYTEST_ARGS ?=

.PHONY: test test-pristine demo setup system-deps ops venv fork sync install export readme check pristine bench cells clean upstream-tests branches branch-tests gpu-evidence gpu-evidence-prepare

test: setup
	$(VPY) -m pytest tests $(PYTEST_ARGS)

# The same tests against pristine upstream (a regression test must fail here).
test-pristine: setup pristine
	PYTHONPATH=$(CURDIR)/pristine $(VPY) -m pytest tests $(PYTEST_ARGS)

# The main job: examples/train.py under the deepspeed launcher on 2 CPU ranks, walking through each fix
# with checks (examples/walkthrough.py; pristine 0.19.8 runs beside the fork for contrast).
demo: setup pristine
	PYTHONPATH=$(CURDIR)/pristine $(VPY) tools/build_ops.py --only ShareMemCommBuilder
	$(VPY) examples/walkthrough.py

setup: system-deps venv fork install ops

# libaio headers for the async_io op (NVMe offload tests); apt-get when root, else a warning.
system-deps:
	@tools/system-deps.sh

venv: $(VENV)/.deps-stamp

$(VENV)/.deps-stamp: requirements/dev-cpu.txt requirements/tests.txt
	test -x $(VPY) || $(PYTHON) -m venv $(VENV)
	$(VPY) -m pip install --quiet --upgrade pip
ifeq ($(TORCH),)
	$(VPY) -m pip install --quiet -r requirements/dev-cpu.txt
else
	$(VPY) -m pip install --quiet torch==$(TORCH) $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	sed -e 's/^torch==.*/torch==$(TORCH)/' -e 's|^-r |-r $(CURDIR)/requirements/|' requirements/dev-cpu.txt \
		>$(VENV)/requirements.txt
	$(VPY) -m pip install --quiet -r $(VENV)/requirements.txt
endif
	touch $@

# Import the series once; `make sync` re-imports after patches/ changed (refuses to drop work; FORCE=1 sets
# fork/ aside as fork.bak-<time> instead).
fork: venv
	test -d fork/.git || $(VPY) $(PATCHES) import

sync: venv
	$(VPY) $(PATCHES) import $(if $(FORCE),--force)

# Editable install of the patched tree; skipped when `deepspeed` already resolves to fork/.
# The install writes its torch into fork/'s build record (deepspeed/git_version_info_installed.py, torch_info), which
# every cell's venv reads: a TORCH cell puts back the record it found (the default cell's, or the sdist's '0.0'
# entries, which pristine/ keeps). PyPI's torch for Linux is a CUDA build: its record (NCCL 2.x, CUDA 12.x) would
# make upstream's bf16_required_version_check pass on the fork and not on pristine, whose bf16 tests would then run
# on one tree only, and in the default cell too.
INSTALLED_INFO := fork/deepspeed/git_version_info_installed.py
install: fork
	@if $(VPY) -c "import deepspeed, pathlib, sys; sys.exit(pathlib.Path(deepspeed.__file__).resolve().parents[1] != pathlib.Path('fork').resolve())" 2>/dev/null; then \
		echo "deepspeed: editable install of fork/ present"; \
	else \
		$(if $(TORCH),cp $(INSTALLED_INFO) $(VENV)/installed-info.before &&) \
		DS_BUILD_OPS=0 $(VPY) -m pip install --quiet --no-build-isolation --no-deps -e fork >$(VENV)/install.log 2>&1 \
			|| { cat $(VENV)/install.log; exit 1; }; \
		$(if $(TORCH),cp $(VENV)/installed-info.before $(INSTALLED_INFO);) \
	fi

# JIT-build the DeepSpeed ops once, before any test's timeout runs (seconds when built; tools/build_ops.py).
ops: install
	$(VPY) tools/build_ops.py

# Write fork/'s commits back to patches/, then README.md's list of patches (generated from patches/series).
export:
	$(VPY) $(PATCHES) export
	$(VPY) $(PATCHES) readme

# README.md's list of patches alone, e.g. after patches/ was edited by hand (a tooling test fails while it is stale).
readme:
	$(VPY) $(PATCHES) readme

check:
	$(VPY) $(PATCHES) check

pristine: venv
	$(VPY) $(PATCHES) pristine

bench: setup pristine
	$(VPY) bench/zero3_master_memory.py
	$(VPY) bench/zero3_resume_cost.py
	$(VPY) bench/zero3_reshard_cost.py
	$(VPY) bench/zero3_reshard_cost.py --stage 2
	$(VPY) bench/zero3_reshard_cost.py --tp
	$(VPY) bench/checkpoint_verify_cost.py
	$(VPY) bench/checkpoint_costs.py

# One run on a single-GPU node as the evidence upstream's skip-gpu-test label asks for (docs/gpu-evidence.md): the
# memory bench with --cuda, 0001's offload round trips and upstream's TestDynamicOffloadStatesZero3 cells at 1 rank
# (fork and 0.19.8), our one-GPU tests; one table, exit 1 if a fork check fails. $(PYTHON): the node's CUDA torch.
# Upstream's tests come from .cache/upstream-tests/tests-upstream/, which `make gpu-evidence-prepare UPSTREAM=DIR`
# (or UPSTREAM=DIR here, or `make upstream-tests`) fills. CPU=1: the same steps in miniature on the CPU accelerator.
GPU_EVIDENCE_ARGS ?=
gpu-evidence: $(if $(CPU),setup)
	$(if $(CPU),$(VPY),$(PYTHON)) tools/gpu_evidence.py $(if $(CPU),--cpu) $(if $(UPSTREAM),--upstream $(UPSTREAM)) \
		$(GPU_EVIDENCE_ARGS)

# For a GPU node without network: upstream's tests (UPSTREAM: a checkout or git dir of upstream DeepSpeed) and wheels
# of the DeepSpeed requirements its image may lack (.cache/gpu-evidence/wheels/); carry both, fork/ and the sdist.
gpu-evidence-prepare: venv
	@test -n "$(UPSTREAM)" || { echo "usage: make gpu-evidence-prepare UPSTREAM=DIR (an upstream DeepSpeed checkout or git dir)"; exit 2; }
	$(VPY) tools/gpu_evidence.py --prepare --upstream $(UPSTREAM)

# The validated-cells matrix from the last test run (markdown; tools/cells.py --help); UPDATE=1 writes it into
# docs/cells.md instead of printing it.
cells:
	$(VPY) tools/cells.py $(if $(UPDATE),--update)

# Upstream DeepSpeed's own test files for the areas the series touches, on pristine 0.19.8 and on the fork,
# compared (tools/upstream_tests.py --help). UPSTREAM: an upstream DeepSpeed checkout or its git directory.
UPSTREAM_TESTS_ARGS ?=
upstream-tests: setup pristine $(VENV)/.upstream-tests-stamp
	@test -n "$(UPSTREAM)" || { echo "usage: make upstream-tests UPSTREAM=DIR (an upstream DeepSpeed checkout or git dir)"; exit 2; }
	$(VPY) tools/upstream_tests.py --upstream $(UPSTREAM) $(UPSTREAM_TESTS_ARGS)

$(VENV)/.upstream-tests-stamp: requirements/upstream-tests.txt $(VENV)/.deps-stamp
	rm -rf .cache/upstream-pytest$(CELL)
	$(VPY) -m pip install --quiet --target .cache/upstream-pytest$(CELL) -r requirements/upstream-tests.txt
	touch $@

# One branch per patch in an upstream DeepSpeed checkout, on BASE plus the patches its `Depends on` line needs, each
# the patch with its tests and its updates of upstream's tests and docs, the message being the pull request's
# description (docs/sending-upstream.md). BASE: the upstream commit the branches start from (default the
# checkout's HEAD); FORCE=1 rewrites the branches of a previous run.
branches: venv
	@test -n "$(UPSTREAM)" || { echo "usage: make branches UPSTREAM=DIR [BASE=REF] [FORCE=1] (an upstream DeepSpeed checkout)"; exit 2; }
	$(VPY) $(PATCHES) branches $(UPSTREAM) $(if $(BASE),--base $(BASE)) $(if $(FORCE),--force)

# Each pull request's tests on its own branch (after `make branches`): the branch's code and tests extracted whole,
# pytest under upstream's harness (tools/branch_tests.py --help).
BRANCH_TESTS_ARGS ?=
branch-tests: setup $(VENV)/.upstream-tests-stamp
	@test -n "$(UPSTREAM)" || { echo "usage: make branch-tests UPSTREAM=DIR (the checkout make branches wrote into)"; exit 2; }
	$(VPY) tools/branch_tests.py --upstream $(UPSTREAM) $(BRANCH_TESTS_ARGS)

clean:
	rm -rf $(VENV) fork pristine .cache
