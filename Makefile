# Two entry points on a fresh machine with python3 and make:
#   make run   - create .venv, install stepcredit, run the main job (stepcredit reproduce
#                --preset quick: the diagnosis and a small training comparison, ~10 minutes)
#   make test  - create .venv, install stepcredit with its test, textworld, torch, tunix and
#                llm extras and verl 0.9.1 (without its dependencies), run the test suite

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# The JAX compilation cache lives outside the clone so reruns compile less.
export JAX_COMPILATION_CACHE_DIR ?= $(HOME)/.cache/stepcredit-jax

.PHONY: run test bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

$(VENV)/.installed-run: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install -q -e .
	touch $@

$(VENV)/.installed-test: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install -q -e '.[test,textworld,torch,tunix,llm]'
	$(BIN)/python -m pip install -q --no-deps 'verl==0.9.1'
	touch $@

run: $(VENV)/.installed-run
	$(BIN)/stepcredit reproduce --preset quick

# The suite runs in two processes: in one process, after compiling every other test's
# executables, jaxlib 0.10.2 crashed (SIGSEGV / abort) while writing a trainer test's
# executable to the persistent compilation cache; each half passes on its own.
# Each half runs on every core (pytest-xdist, `-n auto`): the tests are mostly single-threaded
# JAX compilation.
test: $(VENV)/.installed-test
	$(BIN)/python -m pytest -n auto --ignore=tests/train
	$(BIN)/python -m pytest -n auto tests/train

# Every CPU benchmark whose figures the README quotes, each rewriting its own generated
# section: the kernels and estimators against their peers (RESULTS.md), one server under 100
# clients against the server before issue 24 (SERVER_LOAD.md), and whole training iterations
# before and after the speed-ups (ITERATION_SPEED.md); about 80 minutes of the 2 cores in all.
bench: $(VENV)/.installed-test
	$(BIN)/python -m benchmarks.run --seconds 0.5 --reps 20 --output benchmarks/RESULTS.md
	$(BIN)/python benchmarks/server_load.py --baseline-rev 800e03b --seconds 15 --rounds 3
	$(BIN)/python -m benchmarks.iteration_speed --envs hotpotqa webshop --iterations 20 --warmup 6

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis
