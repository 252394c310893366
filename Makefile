# minipd: `make lab` opens the course, `make test` runs every test and every notebook.
# Override the interpreter or torch build, e.g. `make lab TORCH_SPEC=torch` for your platform's default
# build (CUDA on Linux), or `make lab VENV=~/envs/minipd`.

PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
LAB_ARGS ?=
PY := $(VENV)/bin/python
STAMP := $(VENV)/.minipd-installed
NOTEBOOKS := $(sort $(wildcard chapters/*.ipynb))

export HF_HUB_OFFLINE ?= 1
export TOKENIZERS_PARALLELISM ?= false

.PHONY: install lab test lint unit notebooks nbval clean-venv browser-test

$(PY):
	$(PYTHON) -m venv $(VENV)

# torch first and pinned, so nothing later pulls a different (multi-GB CUDA) build on its own.
$(STAMP): pyproject.toml | $(PY)
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[test]"
	$(PY) -m minipd build-kernels || echo "(the C++ CPU kernel did not build: minipd uses its torch reference)"
	touch $(STAMP)

install: $(STAMP)

# The course in JupyterLab on the bundled model; headless machines get the URL printed instead of a
# browser, and containers that run as root are allowed to.
lab: install
	$(PY) -m jupyter lab --notebook-dir=chapters $(if $(DISPLAY)$(filter Darwin,$(shell uname)),,--no-browser) \
		$(if $(filter 0,$(shell id -u)),--allow-root) $(LAB_ARGS)

test: install lint unit nbval

lint: install
	$(PY) -m ruff check minipd tests scripts

unit: install
	$(PY) -m pytest tests

nbval: install
	$(PY) -m pytest --nbval-lax --nbval-current-env -p no:cacheprovider $(NOTEBOOKS)

# Every chapter run in JupyterLab in headless Chromium (Playwright), widgets moved, screenshots in
# artifacts/browser/. Installs Playwright (the `browser` extra) and Debian's chromium when missing;
# `make browser-test CHROMIUM=/path/to/chrome` uses another, BROWSER_TEST_ARGS="03 04" picks chapters.
CHROMIUM ?= /usr/bin/chromium
BROWSER_TEST_ARGS ?=
browser-test: install
	@$(PY) -c "import playwright" 2>/dev/null || $(PY) -m pip install -q -e ".[browser]"
	@if [ ! -x "$(CHROMIUM)" ]; then \
		if [ "$(CHROMIUM)" = /usr/bin/chromium ] && command -v apt-get >/dev/null 2>&1; then \
			sudo=$$([ "$$(id -u)" = 0 ] || echo "sudo -n"); \
			echo "browser-test: no Chromium at $(CHROMIUM); installing it: apt-get install -y chromium"; \
			DEBIAN_FRONTEND=noninteractive $$sudo apt-get install -y -q chromium >/dev/null \
				|| { $$sudo apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive $$sudo apt-get install -y -q chromium >/dev/null; } \
				|| { echo "browser-test: apt-get could not install chromium" >&2; exit 2; }; \
		else \
			echo "browser-test: no Chromium at $(CHROMIUM) and no apt-get to install it: install Chromium or Chrome," \
				"then run make browser-test CHROMIUM=/path/to/chromium" >&2; exit 2; \
		fi; \
	fi
	CHROMIUM="$(CHROMIUM)" $(PY) scripts/browser_test.py $(BROWSER_TEST_ARGS)

# Re-execute every chapter in place (stored with outputs) and strip what should not be committed.
notebooks: install
	$(PY) -m jupyter nbconvert --to notebook --execute --inplace $(NOTEBOOKS)
	$(PY) scripts/clean_notebooks.py $(NOTEBOOKS)

clean-venv:
	rm -rf $(VENV)
