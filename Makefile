# Two commands for a newcomer: `make bench` (the benchmark report) and `make test`.
# Both create .venv on first use and install the package with its dev extras.
# torch is pinned to the CPU build that lies on this machine's disk; on a GPU
# machine install a CUDA torch in .venv yourself and the pin is left alone.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
TORCH_SPEC ?= torch==2.13.0

.PHONY: test test-matrix bench lint format clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[dev,transformers]"
	touch $(STAMP)

test: $(STAMP)
	$(PY) -m ruff check src tests examples
	$(PY) -m ruff format --check src tests examples
	$(PY) -m pytest -q

# The supported-versions matrix (docs/versions.md) beyond `make test`'s torch 2.13
# CPU build: torch:transformers pairs, each in its own virtual environment under
# MATRIX_DIR, created on first use and reused while pyproject.toml is unchanged.
# torch's CUDA builds (several GB each) run on a CPU-only machine too. The editable
# install is redone before every run, so an environment reused from another clone
# tests this tree.
MATRIX_DIR ?= .venv-matrix
MATRIX ?= 2.6.0:4.46.3 2.11.0:4.57.6 2.14.1:5.24.0
MATRIX_TORCH := $(foreach pair,$(MATRIX),$(firstword $(subst :, ,$(pair))))
transformers_for = $(lastword $(subst :, ,$(filter $(1):%,$(MATRIX))))

$(MATRIX_DIR)/torch-%/.installed: pyproject.toml
	test -x $(@D)/bin/python || $(PYTHON) -m venv $(@D)
	$(@D)/bin/python -m pip install -q --upgrade pip
	$(@D)/bin/python -m pip install -q "torch==$*" "transformers==$(call transformers_for,$*)" -e ".[dev]"
	touch $@

test-matrix: $(foreach v,$(MATRIX_TORCH),$(MATRIX_DIR)/torch-$(v)/.installed)
	failed=""; \
	for v in $(MATRIX_TORCH); do \
		echo "== torch $$v, transformers $$($(MATRIX_DIR)/torch-$$v/bin/python -c 'import transformers; print(transformers.__version__)')"; \
		$(MATRIX_DIR)/torch-$$v/bin/python -m pip install -q --no-deps -e . \
			&& $(MATRIX_DIR)/torch-$$v/bin/python -m pytest -q -x -p no:cacheprovider \
			|| failed="$$failed $$v"; \
	done; \
	test -z "$$failed" || { echo "test-matrix failed on torch$$failed"; exit 1; }

bench: $(STAMP)
	$(PY) -m linear_ce.bench $(ARGS)

lint: $(STAMP)
	$(PY) -m ruff check src tests examples
	$(PY) -m ruff format --check src tests examples

format: $(STAMP)
	$(PY) -m ruff format src tests examples
	$(PY) -m ruff check --fix src tests examples

clean:
	rm -rf $(VENV) $(MATRIX_DIR) .pytest_cache .ruff_cache .hypothesis bench-out
