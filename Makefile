# Two commands matter: `make lab` and `make test` (see README.md).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
TORCH_PIN := torch==2.13.0
SHARED := $(abspath ../shared)

export TIKTOKEN_CACHE_DIR ?= $(if $(wildcard $(SHARED)/tiktoken_cache),$(SHARED)/tiktoken_cache,)

.PHONY: install lab test browser-deps solutions labs bench clean

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

test: install browser-deps
	$(PY) -m distlab labs --check
	$(PY) -m pytest -q tests
	$(PY) -m pytest -q --nbval --nbval-sanitize-with tests/nbval_sanitize.cfg --nbval-cell-timeout 600 -p no:cacheprovider solutions/

# tests/test_browser.py drives JupyterLab in Debian's headless Chromium. Install chromium and
# chromium-driver where we can (root, apt-get, Debian); anywhere else say in one line why that test
# will skip. Never fails: `make test` runs on laptops without root and machines without a mirror.
BROWSER_DEPS := chromium chromium-driver
APT_BROWSER := DEBIAN_FRONTEND=noninteractive apt-get -qq -o Acquire::http::Timeout=30 -o Acquire::Retries=1 \
	-o DPkg::Lock::Timeout=120
BROWSER_LOG := $(or $(TMPDIR),/tmp)/distlab-browser-deps.log
BROWSER_SKIPS := echo "browser test will be skipped:"

browser-deps:
	@if command -v chromium >/dev/null 2>&1 && command -v chromedriver >/dev/null 2>&1; then :; \
	elif [ "$$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1 || \
	     ! grep -qx 'ID=debian' /etc/os-release 2>/dev/null; then \
		$(BROWSER_SKIPS) "chromium and chromedriver are not installed, and make installs them only as root" \
			"on Debian (there: apt-get install $(BROWSER_DEPS))"; \
	elif { $(APT_BROWSER) install -y --no-install-recommends $(BROWSER_DEPS) || \
	       { $(APT_BROWSER) update && $(APT_BROWSER) install -y --no-install-recommends $(BROWSER_DEPS); }; \
	     } >$(BROWSER_LOG) 2>&1; then \
		echo "installed Debian's $(BROWSER_DEPS) for the browser test"; \
	else \
		$(BROWSER_SKIPS) "apt-get could not install $(BROWSER_DEPS) (log: $(BROWSER_LOG))"; \
	fi

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
