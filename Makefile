# Two commands matter: `make lab` and `make test` (see README.md).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
TORCH_PIN := torch==2.13.0
SHARED := $(abspath ../shared)

export TIKTOKEN_CACHE_DIR ?= $(if $(wildcard $(SHARED)/tiktoken_cache),$(SHARED)/tiktoken_cache,)

.PHONY: install lab test solutions labs bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# Install torch only where it is missing: never replace a torch Colab/Kaggle/the user brought.
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH_PIN)" || $(PY) -m pip install -q "torch>=2.8"
	$(PY) -m pip install -q -e ".[test]"
	$(PY) -m ipykernel install --sys-prefix --name python3 >/dev/null
	touch $(STAMP)

install: $(STAMP)

# As root (Docker, Colab terminals) JupyterLab refuses to start without --allow-root.
lab: install
	$(VENV)/bin/jupyter lab labs/ $(if $(filter 0,$(shell id -u)),--allow-root,)

test: install
	$(PY) -m distlab labs --check
	$(PY) -m pytest -q tests
	$(PY) -m pytest -q --nbval --nbval-sanitize-with tests/nbval_sanitize.cfg --nbval-cell-timeout 600 -p no:cacheprovider solutions/

# Maintainers: re-execute solutions in place, then regenerate labs/ from them.
solutions: install
	$(PY) -m distlab notebooks execute solutions/*.ipynb
	$(PY) -m distlab labs

labs: install
	$(PY) -m distlab labs

bench: install
	$(PY) benchmarks/run_all.py

clean:
	rm -rf $(VENV) .pytest_cache
