# The two commands of the README: `make demo` and `make test`. Both install first (idempotent).
VENV ?= .venv
PYTHON := $(VENV)/bin/python

.PHONY: install test test-quick demo bench clean

install:
	@bash scripts/install.sh $(VENV)

test: install
	$(PYTHON) -m pytest

test-quick: install
	$(PYTHON) -m pytest -m "not slow"

demo: install
	$(PYTHON) scripts/demo.py

bench: install
	$(PYTHON) bench/bench_mixers.py

clean:
	rm -rf demo_out
