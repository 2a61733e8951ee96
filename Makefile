# Two commands for a newcomer: `make bench` (the benchmark report) and `make test`.
# Both create .venv on first use and install the package with its dev, docs, transformers and trl extras.
# torch is pinned to the CPU build that lies on this machine's disk; on a GPU
# machine install a CUDA torch in .venv yourself and the pin is left alone.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
TORCH_SPEC ?= torch==2.13.0

.PHONY: test test-avx2 test-matrix bench lint format clean mutate docs

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[dev,docs,transformers,trl]"
	touch $(STAMP)

# The suite runs with the fixed-rule plan (LINEAR_CE_MEASURE=0): a measured plan depends on the
# machine, its load and ~/.cache, so CI would not be reproducible; tests/test_machine_plan.py
# exercises measuring itself, and the suites pass under every forced choice (docs/benchmarks.md).
test: $(STAMP)
	$(PY) -m ruff check src tests examples
	$(PY) -m ruff format --check src tests examples
	LINEAR_CE_MEASURE=0 $(PY) -m pytest -q

# An AVX2-only CPU (no AVX-512, no native bf16 GEMMs) on any x86-64 machine: ATen's, MKL's and
# oneDNN's AVX2 kernels, the compiled row loops built without AVX-512 into a fresh cache
# directory, CPU half GEMMs off; Inductor's cache in that directory too (its keys leave out
# the CPU capability, so a kernel generated for one would be reused for the other, wrong).
# Runs the tests that compare paths and bounds, the ones whose rounding differs between 8-
# and 16-lane sums (~3 minutes on 2 cores); the whole suite so:
# `make test-avx2 AVX2_TESTS=tests`. Fails first if ATen did not take its AVX2 kernels.
AVX2_CC ?= cc -mno-avx512f
AVX2_TESTS ?= tests/test_native_rows.py \
	tests/test_objectives_builtin.py::test_sequence_builtin_matches_formula_float64 \
	tests/test_sparse_divergence.py::test_float64_reference_own_error \
	tests/test_machine_plan.py::test_bench_reports_the_distillation_plan
test-avx2: $(STAMP)
	cache=$$(mktemp -d) && trap 'rm -rf "$$cache"' EXIT && \
	export ATEN_CPU_CAPABILITY=avx2 MKL_CBWR=AVX2 ONEDNN_MAX_CPU_ISA=AVX2 CC="$(AVX2_CC)" \
		LINEAR_CE_NATIVE_HALF_GEMM=0 LINEAR_CE_CACHE_DIR="$$cache" LINEAR_CE_MEASURE=0 \
		TORCHINDUCTOR_CACHE_DIR="$$cache/inductor" && \
	$(PY) -c "import torch; c = torch.backends.cpu.get_cpu_capability(); \
		assert c == 'AVX2', f'ATEN_CPU_CAPABILITY=avx2 not taken: {c}'" && \
	$(PY) -m pytest -q -p no:cacheprovider $(AVX2_TESTS)

# The supported-versions matrix (docs/versions.md) beyond `make test`'s torch 2.13
# CPU build: torch:transformers:python rows, each in its own virtual environment
# MATRIX_DIR/<torch>-<transformers>-<python>, created on first use and reused while
# pyproject.toml is unchanged. torch's CUDA builds (several GB each) run on a
# CPU-only machine too. PYENV_VERSION lets pyenv's shims find a Python that is not
# the active one; without pyenv, python3.X must be on PATH. The editable install is
# redone before every run, so an environment reused from another clone tests this tree.
# The rows run one after another, each installed just before its suite (never two
# suites at once, also under `make -j`: on a small machine the multi-process tests of
# two suites sharing the cores time out), and every row runs whatever the others did.
# Each suite runs with the fixed-rule plan, as `make test`.
# One row alone: `make test-matrix MATRIX=2.6.0:4.46.3:3.10`; install one ahead of
# time: `make .venv-matrix/2.6.0-4.46.3-3.10/.installed`.
MATRIX_DIR ?= .venv-matrix
MATRIX ?= 2.6.0:4.46.3:3.10 2.11.0:4.57.6:3.11 2.14.1:5.24.0:3.11
MATRIX_ENVS := $(subst :,-,$(MATRIX))
# pip arguments of a row's first install: PyPI's torch wheels are CUDA builds (several GB);
# `--find-links DIR` with a downloaded CPU wheel (torch==X is met by X+cpu), or an index
# of CPU builds, installs the CPU build instead.
MATRIX_PIP_ARGS ?=
MATRIX_PYTEST_ARGS ?= -q -p no:cacheprovider
pin = $(word $(2),$(subst -, ,$(1)))

$(MATRIX_DIR)/%/.installed: pyproject.toml
	test -x $(@D)/bin/python || PYENV_VERSION=$(call pin,$*,3) python$(call pin,$*,3) -m venv $(@D)
	$(@D)/bin/python -m pip install -q --upgrade pip
	$(@D)/bin/python -m pip install -q $(MATRIX_PIP_ARGS) "torch==$(call pin,$*,1)" "transformers==$(call pin,$*,2)" -e ".[dev]"
	touch $@

test-matrix:
	failed=""; \
	for env in $(MATRIX_ENVS); do \
		echo "== torch, transformers, python: $$env ($$(git rev-parse --short HEAD 2>/dev/null), $$(date -u +%FT%TZ))"; \
		$(MAKE) --no-print-directory MATRIX_DIR=$(MATRIX_DIR) $(MATRIX_DIR)/$$env/.installed \
			&& $(MATRIX_DIR)/$$env/bin/python -m pip install -q --no-deps -e . \
			&& LINEAR_CE_MEASURE=0 $(MATRIX_DIR)/$$env/bin/python -m pytest $(MATRIX_PYTEST_ARGS) \
			|| failed="$$failed $$env"; \
	done; \
	test -z "$$failed" || { echo "test-matrix failed on:$$failed"; exit 1; }

bench: $(STAMP)
	$(PY) -m linear_ce.bench $(ARGS)

# The docs site (mkdocs.yml) into build/site: README.md as the front page, the guides of docs/,
# a reference page per public name. --strict: a warning (a broken link or anchor, a docstring
# griffe cannot read) fails the build.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict

# Not part of `make test`: applies each deliberate mistake of scripts/mutate.py to a
# scratch copy and reports the ones the suite lets through (~20 minutes on 2 cores;
# ARGS=--quick: one per family, run by .ci/run; ARGS=--list: what there is).
mutate: $(STAMP)
	$(PY) scripts/mutate.py $(ARGS)

lint: $(STAMP)
	$(PY) -m ruff check src tests examples
	$(PY) -m ruff format --check src tests examples

format: $(STAMP)
	$(PY) -m ruff format src tests examples
	$(PY) -m ruff check --fix src tests examples

clean:
	rm -rf $(VENV) $(MATRIX_DIR) .pytest_cache .ruff_cache .hypothesis bench-out build dist
