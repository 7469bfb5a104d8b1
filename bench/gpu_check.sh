#!/bin/sh
# The GPU check on a machine prepared by bench/gpu_pack.sh: the carried wheels and cag itself (built
# from this tree, no index) go to a folder of their own ahead of the image's packages; without the
# embedded model's weights it runs their config on random weights (--shape); the carried datasets are
# read; bench/gpu_check.py writes its report to $OUT (else bench/results). Arguments pass through.
set -eu
cd "$(dirname "$0")/.."
PY=${PY:-python3}
if [ -d .gpu/whl ]; then
  site=${TMPDIR:-/tmp}/cag-gpu-site
  rm -rf "$site"
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" .gpu/whl/*.whl
  $PY -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --no-cache-dir --upgrade --target "$site" .
  # the installed cag (its packages mapped as pyproject says) ahead of this tree's folders; bench from here
  export PYTHONPATH="$site:$PWD"
fi
# run from the site: `python -m` puts the working directory first on sys.path, where this tree's cag/
# (without store/, api/, ... mapped into it) would shadow the installed one
repo=$PWD
cd "${site:-.}"
if [ -d "$repo/.gpu/shape" ] && ! $PY -c "from cag.model.loading import _gguf_dir; _gguf_dir()" 2>/dev/null; then
  set -- --shape "$repo/.gpu/shape" "$@"
fi
if [ -d "$repo/.gpu/datasets" ]; then export CAG_DATASETS="${CAG_DATASETS:-$repo/.gpu/datasets}"; fi
export OUT="${OUT:-$repo/bench/results}"
PYTHONUNBUFFERED=1 exec $PY -m bench.gpu_check "$@"
