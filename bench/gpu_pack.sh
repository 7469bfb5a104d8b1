#!/bin/sh
# What the GPU check needs on a machine with no package index, packed into .gpu/ (git-ignored):
#   .gpu/whl/       wheels of the packages such an image lacks (the H200 image's list: see
#                   docs/development.md), at the versions installed here, for Python $GPU_PYTHON (3.12)
#   .gpu/shape/     the embedded model's config, tokenizer and chat template without its weights
#                   (~90 MB, over what travels): the check runs that config on random weights
#   .gpu/datasets/  the SQuAD and essay files the check reads (from $CAG_DATASETS or ../shared/datasets)
# Run it here with the project's environment active; then on the GPU machine, with .gpu carried:
#   make gpu-check PY=python3       (the same as: sh bench/gpu_check.sh)
set -eu
cd "$(dirname "$0")/.."
PY=${PY:-python}
GPU_PYTHON=${GPU_PYTHON:-3.12}
NAMES="transformers pydantic pydantic-core pydantic-settings annotated-types typing-inspection typing-extensions
python-dotenv blake3 sqlite-utils sqlite-fts4 click-default-group"
rm -rf .gpu/whl && mkdir -p .gpu/whl .gpu/datasets
for name in $NAMES; do
  version=$($PY -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$name")
  $PY -m pip download -q --no-deps --only-binary=:all: --python-version "$GPU_PYTHON" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform any -d .gpu/whl "$name==$version" 2>&1 | grep -v "^WARNING: Location" || true
  ls .gpu/whl | grep -qi "^$(echo "$name" | tr - _)-$version" || { echo "error: no wheel of $name==$version" >&2; exit 1; }
done
$PY -c "import sys; from bench.gpu_check import pack_shape; pack_shape(sys.argv[1])" .gpu/shape
src=${CAG_DATASETS:-../shared/datasets}
for d in squad_v1.1_dev paul_graham_essays_niah; do
  rm -rf ".gpu/datasets/$d" && cp -r "$src/$d" .gpu/datasets/ && chmod -R u+w ".gpu/datasets/$d"
done
du -sh .gpu/whl .gpu/shape .gpu/datasets
