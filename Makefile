# The two commands of the README: `make demo` and `make test`.
# Each creates .venv on first use and installs what it needs.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?=

.PHONY: demo test test-slow docs docs-serve bench clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

$(VENV)/.installed-examples: pyproject.toml | $(PY)
	$(PY) -m pip install -q -e ".[examples]"
	touch $@

$(VENV)/.installed-test: pyproject.toml | $(PY)
	$(PY) -m pip install -q -e ".[test,docs]"
	touch $@

demo: $(VENV)/.installed-examples
	$(PY) examples/quickstart.py

test: $(VENV)/.installed-test
	$(PY) -m pytest -n 2 $(PYTEST_ARGS)

test-slow: $(VENV)/.installed-test
	$(PY) -m pytest -n 2 -m slow --run-slow $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) site build *.egg-info
