# `make demo` and `make test` create .venv when it is missing, with a Python >= 3.12 found by scripts/find-python.
VENV := .venv
BIN := $(VENV)/bin
# The demo's environment is the default install (jax for CPU, the compiler, the data tools: about 1 GB); the tests
# add pytest and grain; the slow tier and the aot report add the chips' deviceless compilers (libtpu, the CUDA
# plugin and cuDNN: about 3 GB more, a minute of installing on 2 cores).
DEMO_STAMP := $(VENV)/.installed-demo
TEST_STAMP := $(VENV)/.installed-test
CHIPS_STAMP := $(VENV)/.installed-chips
DEMO := build/demo

.PHONY: demo test test-slow generate aot-report fixtures check-export clean

$(VENV)/bin/python:
	@py=$$(scripts/find-python) && echo "creating $(VENV) with $$py" && "$$py" -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(DEMO_STAMP): pyproject.toml | $(VENV)/bin/python
	$(BIN)/pip install -q -e .
	touch $(DEMO_STAMP)

$(TEST_STAMP): pyproject.toml | $(VENV)/bin/python
	$(BIN)/pip install -q -e '.[dev,bench]'
	touch $(TEST_STAMP) $(DEMO_STAMP)

$(CHIPS_STAMP): pyproject.toml | $(VENV)/bin/python
	$(BIN)/pip install -q -e '.[dev,bench,tpu,gpu-aot]'
	touch $(CHIPS_STAMP) $(TEST_STAMP) $(DEMO_STAMP)

# The path a user takes with their own text: a tokenizer, a dataset with an eval split, a program, a run that
# evaluates and resumes, and its report (build/demo/run/report.png).
demo: $(DEMO_STAMP)
	rm -rf $(DEMO)
	$(BIN)/axgen corpus $(DEMO)/corpus
	$(BIN)/axgen tokenizer train $(DEMO)/corpus --vocab-size 512 --out $(DEMO)/tokenizer.json
	$(BIN)/axgen data $(DEMO)/corpus --tokenizer $(DEMO)/tokenizer.json --eval-fraction 0.05 --out $(DEMO)/dataset
	$(BIN)/axgen build llama_tiny --target cpu-8 --out $(DEMO)/llama_tiny_cpu_8.py
	$(BIN)/python $(DEMO)/llama_tiny_cpu_8.py --data $(DEMO)/dataset --run-dir $(DEMO)/run --steps 300 \
		--log-every 50 --eval-every 100 --eval-batches 4
	@echo "--- second run: resumes from the newest checkpoint and continues to step 340"
	$(BIN)/python $(DEMO)/llama_tiny_cpu_8.py --data $(DEMO)/dataset --run-dir $(DEMO)/run --steps 340 \
		--log-every 20 --eval-every 100 --eval-batches 4
	$(BIN)/axgen report $(DEMO)/run

# The quick tier (README: Tests): formatting, generated/ against the compiler, and every test but the slow tier.
test: $(TEST_STAMP)
	$(BIN)/black --check --quiet .
	$(BIN)/axgen build --all --check
	$(BIN)/python -m pytest

# The slow tier: deviceless compiles for the chips, jobs of several processes, the installed wheel. CI runs it
# after `make test`.
test-slow: $(CHIPS_STAMP)
	$(BIN)/python -m pytest -m slow

generate: $(DEMO_STAMP)
	$(BIN)/axgen build --all

# Compiles every spec x target for its chips (minutes per 7B+ program): docs/aot.md.
aot-report: $(CHIPS_STAMP)
	$(BIN)/axgen aot --all --report docs/aot.md

# Needs Python 3.11 with torch: see tests/fixtures/make_hf_fixtures.py.
fixtures:
	python3 tests/fixtures/make_hf_fixtures.py

# transformers loads every family `axgen export-hf` writes and computes HF's logits. HF_PYTHON: a Python with
# torch 2.13.0 and transformers 5.23.0 (tests/fixtures/make_hf_fixtures.py says how to make one).
HF_PYTHON ?= python3
check-export: $(TEST_STAMP)
	rm -rf build/check-export
	PYTHONPATH=. $(BIN)/python tests/fixtures/check_export_in_transformers.py export build/check-export
	$(HF_PYTHON) tests/fixtures/check_export_in_transformers.py check build/check-export

clean:
	rm -rf $(VENV) build .pytest_cache
