# The two commands a newcomer runs: `make demo` and `make test`.
# Both build .venv from nothing when it is missing, installing with constraints.txt.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test lint bench fuzz clean

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check -c constraints.txt -e '.[test]'
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m hurraykv.demo

test: $(STAMP)
	$(VENV)/bin/ruff check src tests benchmarks
	$(PY) -m pytest

bench: $(STAMP)
	$(PY) -m pip install -q --disable-pip-version-check -c constraints.txt -e '.[bench]'
	$(PY) benchmarks/bench_paged.py
	$(PY) benchmarks/bench_quant.py
	$(PY) benchmarks/bench_snapshot.py
	$(PY) benchmarks/bench_net.py
	$(PY) benchmarks/bench_store.py

FUZZ_SECONDS ?= 120
fuzz: $(STAMP)
	$(PY) -m pip install -q --disable-pip-version-check -c constraints.txt -e '.[fuzz]'
	$(PY) -m tests.fuzz.run --seconds $(FUZZ_SECONDS)

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache .ruff_cache .hypothesis fuzz-findings
