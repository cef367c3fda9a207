# The commands of the README (`make demo`, `make test`) and of CONTRIBUTING.md
# (`make test-fast`, `make test-min` and the rest). Each creates .venv
# (test-min: .venv-min) on first use and installs what it needs; VENV=path
# uses another virtual environment.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?=

.PHONY: demo test test-fast test-min test-slow docs docs-serve bench bench-gpu clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

$(VENV)/.installed-examples: pyproject.toml | $(PY)
	$(PY) -m pip install -q -e ".[examples]"
	touch $@

$(VENV)/.installed-test: pyproject.toml | $(PY)
	$(PY) -m pip install -q -e ".[test,docs]"
	touch $@

# Trains a small transformer LM in float32, bfloat16 and float16 (2 min 52 s
# on 2 idle CPU cores, 7 min under load); prints a table and writes
# runs/<timestamp>/metrics.json and loss.png. Flags through DEMO_ARGS, e.g.
# DEMO_ARGS="--steps 2000", or DEMO_ARGS="--fp8" to add an FP8 run (emulated on
# a CPU: numerics, not speed).
demo: $(VENV)/.installed-examples
	$(PY) examples/train_lm.py $(DEMO_ARGS)

# Guard overhead vs jmp/optax/flax, and float32 vs bf16 vs fp16 step time;
# writes benchmarks/results/ (several minutes).
bench: $(VENV)/.installed-examples
	$(PY) benchmarks/overhead.py
	$(PY) benchmarks/policy_speed.py

# On one NVIDIA GPU (an H100 or H200; at most 8 minutes): float32, bfloat16,
# float16 and FP8 at 124M and 4.1M parameters, the guard against its peers and
# where the step's time goes (benchmarks/gpu.py); writes
# benchmarks/results/gpu/gpu.{md,json}. Installs JAX's CUDA wheels (GPU_JAX);
# where Python already has them, `python benchmarks/gpu.py` runs the same.
# Flags through BENCH_ARGS, e.g. BENCH_ARGS="--budget-seconds 300".
GPU_JAX ?= jax[cuda12]

$(VENV)/.installed-gpu: pyproject.toml | $(PY)
	$(PY) -m pip install -q -e ".[examples]" "$(GPU_JAX)"
	touch $@

bench-gpu: $(VENV)/.installed-gpu
	$(PY) benchmarks/gpu.py $(BENCH_ARGS)

# Everything: the unit tier, the integration tier (examples, benchmarks,
# several processes, the documentation site, long fault-injection runs) and the
# doctests of jaxmp/, on two cores.
test: $(VENV)/.installed-test
	$(PY) -m pytest -n 2 $(PYTEST_ARGS)

# The unit tier and the doctests (CONTRIBUTING.md gives the measured times
# and where they go): run it before every commit.
test-fast: $(VENV)/.installed-test
	$(PY) -m pytest -n 2 -m "not integration" $(PYTEST_ARGS)

# The unit tier on the lowest supported versions: its own virtual environment
# (VENV_MIN) with exactly the lower bounds of pyproject.toml's dependencies
# and of its flax extra (each ">=" made "=="), and the test extra.
VENV_MIN ?= .venv-min
MIN_PINS = $(shell $(PYTHON) -c 'import tomllib; p = tomllib.load(open("pyproject.toml", "rb"))["project"]; print(" ".join(d.replace(">=", "==") for d in p["dependencies"] + p["optional-dependencies"]["flax"]))')

$(VENV_MIN)/.installed-min: pyproject.toml
	test -n "$(MIN_PINS)"  # the pins, read with Python 3.11's tomllib
	rm -rf $(VENV_MIN)
	$(PYTHON) -m venv $(VENV_MIN)
	$(VENV_MIN)/bin/python -m pip install -q --upgrade pip
	$(VENV_MIN)/bin/python -m pip install -q -e ".[test]" $(MIN_PINS)
	touch $@

test-min: $(VENV_MIN)/.installed-min
	$(VENV_MIN)/bin/python -m pytest -n 2 -m "not integration" $(PYTEST_ARGS)

test-slow: $(VENV)/.installed-test
	$(PY) -m pytest -n 2 -m slow --run-slow $(PYTEST_ARGS)

# The documentation site: built strictly into site/, or served on 127.0.0.1:8000.
docs: $(VENV)/.installed-test
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict --site-dir site

docs-serve: $(VENV)/.installed-test
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs serve --dev-addr 127.0.0.1:8000

clean:
	rm -rf $(VENV) $(VENV_MIN) site build *.egg-info
