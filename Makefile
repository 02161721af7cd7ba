# Two commands matter: `make lab` and `make test` (see README.md).
SHELL := bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# The venv's python by its real path. pip writes the interpreter it ran under into every script it installs
# (`distlab`, `jupyter`) and the kernel spec names it: installed through a symlinked .venv (the instructor
# guide's test does that) they must not point at the link's folder, which goes away.
REAL_PY = "$$(cd $(VENV) && pwd -P)/bin/python"
VENV_TIKTOKEN := $(VENV)/share/distlab/tiktoken_cache
LOCK := requirements.lock
LATEST := .venv-latest
TORCH_PIN := torch==2.13.0
SHARED := $(abspath ../shared)

export TIKTOKEN_CACHE_DIR ?= $(abspath $(VENV_TIKTOKEN))

.PHONY: install lab test test-phases test-latest lock browser-deps solutions labs bench mutants gpu-check clean

# The interpreter .venv is made from: Python 3.10-3.13 with its venv module (a separate package on Debian and
# Ubuntu, python3-venv). Another one is chosen with `make lab PYTHON=python3.12`. Each way this fails is one line,
# and a half-made .venv is removed, so the next `make` starts clean.
MAKE_VENV = { command -v $(PYTHON) >/dev/null || { echo "make: no $(PYTHON) on PATH; name a Python 3.10-3.13 with \
	make lab PYTHON=python3.12" >&2; exit 1; }; } && \
	$(PYTHON) -c 'import sys; sys.exit(0 if (3, 10) <= sys.version_info[:2] <= (3, 13) else "make: $(PYTHON) is \
	Python %d.%d; distlab needs 3.10-3.13: make lab PYTHON=python3.12 (or another 3.10-3.13)" % sys.version_info[:2])' \
	&& { $(PYTHON) -m venv $(VENV) >/dev/null 2>&1 || { rm -rf $(VENV); echo "make: $(PYTHON) -m venv failed: \
	on Debian/Ubuntu install python3-venv (python3.X-venv for PYTHON=python3.X), or without root use conda \
	(README.md)" >&2; exit 1; }; }

# Every dependency but torch installs at the exact version in $(LOCK) (one file, every transitive version,
# Python 3.10-3.13 on Linux and macOS), so a course that passes today passes next term. `make lock` writes it;
# CONTRIBUTING says when. torch stays outside the lock: installed only where missing, and on Linux without an
# NVIDIA GPU from PyTorch's CPU wheel index, falling back to PyPI where that index cannot be reached
# (tools/install_torch.py says why; README.md what each platform downloads).
$(STAMP): pyproject.toml $(LOCK)
	@test -x $(PY) || $(MAKE_VENV)
	$(REAL_PY) -m pip install -q --upgrade pip
	$(REAL_PY) tools/install_torch.py "$(TORCH_PIN)" --python $(REAL_PY)
	$(REAL_PY) -m pip install -q -r $(LOCK)
	$(REAL_PY) -m pip install -q --no-deps -e .
	# cloudpickle 3.1.2, the last release that kept code objects' file names, beside the locked one:
	# tests/test_payload.py runs the ranks' error reports under both
	$(REAL_PY) -m pip install -q --no-deps --upgrade --target $(VENV)/compat/cloudpickle-3.1.2 cloudpickle==3.1.2
	# ipykernel's install leaves the kernel spec's temporary copy behind (tmp…_kernels): made in .venv, removed
	mkdir -p $(VENV)/tmp && TMPDIR=$(VENV)/tmp $(REAL_PY) -m ipykernel install --sys-prefix --name python3 >/dev/null
	rm -rf $(VENV)/tmp
	# GPT-2's BPE files for lab 10, inside the venv, so the course runs offline after this one install
	mkdir -p $(VENV_TIKTOKEN)
	if [ -d "$(SHARED)/tiktoken_cache" ]; then cp -f "$(SHARED)"/tiktoken_cache/* $(VENV_TIKTOKEN)/; \
	elif ! TIKTOKEN_CACHE_DIR=$(VENV_TIKTOKEN) $(REAL_PY) -c "import tiktoken; tiktoken.get_encoding('gpt2')" \
		2>/dev/null; then echo "GPT-2's tokenizer files could not be fetched: lab 10 fetches them at first use"; fi
	touch $(STAMP)

install: $(STAMP)

# As root (Docker, Colab terminals) JupyterLab refuses to start without --allow-root.
lab: install
	$(VENV)/bin/jupyter lab labs/ $(if $(filter 0,$(shell id -u)),--allow-root,)

# The suite runs as a fresh machine would: tests/fresh_machine.py points the temporary folder, Ray's root and the
# home folder (~/.cache, ~/.jupyter, ~/.ipython, ~/.local) into one new scratch folder for the run, removed
# afterwards unless the run failed (CONTRIBUTING: "A fresh machine, every run").
test: install browser-deps
	$(PY) -m distlab labs --check
	$(VENV)/bin/ruff check --quiet .
	@$(PY) tests/fresh_machine.py -- $(MAKE) --no-print-directory test-phases

# make test's two phases, as make test runs them (in its scratch folder). Tests and notebooks are spread over
# TEST_WORKERS processes (pytest-xdist; by default one per core this process may use, at most 4, since each test
# starts ranks of its own): a test module, or a notebook, runs whole on one worker, and the longest modules start
# first (tests/conftest.py). Each phase prints its wall time, so a slow suite shows where the time went.
TEST_WORKERS ?= $(shell $(PY) -c 'import os; print(min(4, len(os.sched_getaffinity(0)) \
	if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1))')
XDIST = -n $(TEST_WORKERS)
# The solutions for nbval, longest first (cell seconds on 2 cores: 13, 11, 04, 12, 03, 06 take 24-32 s each, the rest
# 4-15 s), so that the last one to start does not end the phase alone on one worker; the rest in lab order.
LONGEST_NOTEBOOKS := $(foreach n,13 11 04 12 03 06,$(wildcard solutions/$(n)_*.ipynb))
NOTEBOOKS := $(LONGEST_NOTEBOOKS) $(filter-out $(LONGEST_NOTEBOOKS),$(sort $(wildcard solutions/*.ipynb)))
test-phases:
	@SECONDS=0; $(PY) -m pytest -q --durations=20 $(XDIST) --dist loadscope --no-loadscope-reorder tests; \
		status=$$?; echo "make test: tests took $$SECONDS s"; exit $$status
	@SECONDS=0; $(PY) -m pytest -q $(XDIST) --dist loadfile --no-loadscope-reorder --nbval \
		--nbval-sanitize-with tests/nbval_sanitize.cfg --nbval-cell-timeout 600 -p no:cacheprovider $(NOTEBOOKS); \
		status=$$?; echo "make test: nbval took $$SECONDS s"; exit $$status

# The next drift, before students see it: the newest version of every dependency pyproject.toml allows, in a
# scratch venv, through the runtime's tests and the notebook tooling's (the parts that lean on dependencies'
# behaviour). It prints each package whose newest version differs from the lock first.
LATEST_TESTS := tests/test_payload.py tests/test_launcher.py tests/test_launcher_faults.py tests/test_notebooks.py \
	tests/grading/test_grading_lab00_02.py tests/grading/test_grading_quiz_labs00_03.py

test-latest:
	rm -rf $(LATEST)
	$(PYTHON) -m venv $(LATEST)
	$(LATEST)/bin/python -m pip install -q --upgrade pip
	$(LATEST)/bin/python tools/install_torch.py "$(TORCH_PIN)" --python $(LATEST)/bin/python
	$(LATEST)/bin/python -m pip install -q --upgrade --upgrade-strategy eager -e ".[test]"
	$(LATEST)/bin/python -m pip install -q --no-deps --target $(LATEST)/compat/cloudpickle-3.1.2 cloudpickle==3.1.2
	mkdir -p $(LATEST)/tmp && TMPDIR=$(LATEST)/tmp $(LATEST)/bin/python -m ipykernel install --sys-prefix \
		--name python3 >/dev/null
	rm -rf $(LATEST)/tmp
	$(LATEST)/bin/python -m distlab lock-drift $(LOCK)
	$(LATEST)/bin/python -m pytest -q -p no:cacheprovider $(LATEST_TESTS)

# Maintainers: rewrite the lock from pyproject.toml's ranges (needs PyPI). torch is left out by an override
# that can never match; the lock's header records this command.
lock:
	$(PY) -m pip install -q uv
	printf 'torch ; python_version < "0"\n' > $(VENV)/lock-overrides.txt
	$(VENV)/bin/uv pip compile pyproject.toml --extra test --universal --python-version 3.10 \
		--override $(VENV)/lock-overrides.txt --custom-compile-command "make lock" -o $(LOCK)

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

# Maintainers: re-execute solutions in place, tag the cells no check needs (the grader skips them), then
# regenerate labs/ from them.
solutions: install
	$(PY) -m distlab notebooks execute solutions/*.ipynb
	$(PY) -m distlab notebooks tag solutions/*.ipynb
	$(PY) -m distlab labs

labs: install
	$(PY) -m distlab notebooks tag solutions/*.ipynb
	$(PY) -m distlab labs

bench: install
	$(PY) benchmarks/run_all.py

# Mutation testing of the checkers: every exercise's reference solution with one change at a time, each checked in
# its own forked process (lib/distlab/mutants.py). Resumable; `make mutants LABS="03 05"` for some labs. Writes
# benchmarks/results/mutants.json and mutants.txt. Hours for every lab on 2 cores.
mutants: install
	$(PY) -m distlab notebooks mutants $(if $(LABS),--labs $(LABS),)

clean:
	rm -rf $(VENV) .pytest_cache

# Every CUDA path of the course on this machine's GPUs, within a time budget; without a GPU it says so in one
# line. Writes benchmarks/results/gpu.json and gpu.txt (CONTRIBUTING: "GPU evidence").
gpu-check: install
	$(PY) benchmarks/gpu_check.py
