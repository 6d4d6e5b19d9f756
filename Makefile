# `make demo` and `make test` each set up .venv on a fresh machine, then run.
PY := .venv/bin/python
STAMP := .venv/.installed

.PHONY: demo test test-fast bench install clean

$(PY):
	python3 -m venv .venv

# torch first, pinned. Which build: pip's own configuration decides (a local CPU wheel where its
# find-links hold one, as on the CI machine); PyPI's default Linux wheel bundles CUDA (several GB).
# TORCH_INDEX=https://download.pytorch.org/whl/cpu takes the CPU build from PyTorch's index.
TORCH_INDEX ?=
$(STAMP): $(PY) setup.py
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q torch==2.13.0 $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	$(PY) -m pip install -q -e ".[dev]"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(PY) -m mode.cli compare configs/experiments/quickstart.yaml

# Two pytest workers (pytest-xdist), each taking whole files, so module and session fixtures (runs
# shared by a file's tests) are built once per worker: on 2 cores the suite takes half the wall time,
# since a starting process spends most of a tiny run importing torch on one core. TEST_WORKERS=0 runs
# in one process. Files go out heaviest first (tests/conftest.py FILE_SECONDS).
TEST_WORKERS ?= 2
XDIST = $(if $(filter-out 0,$(TEST_WORKERS)),-n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder)

test: $(STAMP)
	$(PY) -m pytest -q $(XDIST) tests

# Unit tier: no process starts, no training (tests marked `slow` are deselected).
test-fast: $(STAMP)
	$(PY) -m pytest -q $(XDIST) -m "not slow" tests

bench: $(STAMP)
	$(PY) benchmarks/bench_mod.py
	$(PY) benchmarks/bench_moe.py
	$(PY) benchmarks/bench_data.py

clean:
	rm -rf .venv runs
