#!/usr/bin/env bash
# Download the wheels the GPU machine's image lacks (pydantic and its dependencies) into .whl/ (git-ignored),
# for the device tool's `carry`. The paged kernel needs Triton, which that image already has (triton 3.6 with
# torch 2.11+cu130, per the device notes): no wheel for it. Run here, in the repository root, before a GPU run:
#   bash benchmarks/fetch_device_wheels.sh
# then on the device:
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
#   python3 benchmarks/gpu_check.py --out $OUT
set -euo pipefail
rm -rf .whl && mkdir -p .whl
for pkg in pydantic==2.13.4 pydantic_core==2.46.4 annotated_types==0.7.0 typing_extensions==4.15.0 \
           typing_inspection==0.4.2; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform any -d .whl "$pkg"
done
ls -la .whl
