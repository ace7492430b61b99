#!/usr/bin/env bash
# Download (here, where a package index is reachable) the wheels that a bare GPU image without
# network access needs to run benchmarks/gpu_check.sh: ds_xc's dependencies that such images lack.
#   bash benchmarks/gpu_wheels.sh [python version, default 3.12]   -> .whl/
set -euo pipefail
cd "$(dirname "$0")/.."
PYV=${1:-3.12}
mkdir -p .whl
PLAT=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
      --platform manylinux2014_x86_64)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$PYV" --implementation cp \
    "${PLAT[@]}" -d .whl faiss-cpu==1.15.1 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types \
    typing-inspection hjson
# deepspeed ships as a source archive only: build its pure-Python wheel here
python3 -m pip wheel -q --no-deps --no-build-isolation -w .whl deepspeed==0.19.8
ls -la .whl
