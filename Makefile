# Two commands for a newcomer: `make bench` (the benchmark report) and `make test`.
# Both create .venv on first use and install the package with its dev extras.
# torch is pinned to the CPU build that lies on this machine's disk; on a GPU
# machine install a CUDA torch in .venv yourself and the pin is left alone.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
TORCH_SPEC ?= torch==2.13.0

.PHONY: test bench lint format clean mutate

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

bench: $(STAMP)
	$(PY) -m linear_ce.bench $(ARGS)

# Not part of `make test`: applies each deliberate mistake of scripts/mutate.py to a
# scratch copy and reports the ones the suite lets through (a few minutes).
mutate: $(STAMP)
	$(PY) scripts/mutate.py $(ARGS)

lint: $(STAMP)
	$(PY) -m ruff check src tests examples
	$(PY) -m ruff format --check src tests examples

format: $(STAMP)
	$(PY) -m ruff format src tests examples
	$(PY) -m ruff check --fix src tests examples

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis bench-out build dist
