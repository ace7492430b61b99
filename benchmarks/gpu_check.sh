#!/usr/bin/env bash
# The device check (benchmarks/gpu_check.py) on a machine with one CUDA GPU.
#
#   bash benchmarks/gpu_check.sh              # everything; < 8 min on one H200
#   bash benchmarks/gpu_check.sh --dry-run    # no GPU: the same steps, CUDA parts skipped
#
# It uses the machine's own python3 and torch (a CUDA build). What that machine lacks and ds_xc
# needs (deepspeed, faiss-cpu, pydantic, hjson) is installed from wheels in .whl/ when that folder
# exists (made beforehand by `bash benchmarks/gpu_wheels.sh` on a machine with a package index; a
# machine with one can simply `pip install -e .` instead), into a private folder on PYTHONPATH.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
    echo "gpu_check: installing $(ls .whl/*.whl | wc -l) carried wheels into /tmp/ds_xc_site"
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/ds_xc_site .whl/*.whl
    export PYTHONPATH="/tmp/ds_xc_site${PYTHONPATH:+:$PYTHONPATH}"
fi
# the ops/ folder installs as ds_xc_ops: without an install, a link in a private folder stands in
mkdir -p /tmp/ds_xc_src && ln -sfn "$PWD/ops" /tmp/ds_xc_src/ds_xc_ops
export PYTHONPATH="$PWD:/tmp/ds_xc_src${PYTHONPATH:+:$PYTHONPATH}"
missing=$("$PY" - <<'PY'
import importlib.util
print(" ".join(m for m in ("torch", "deepspeed", "faiss", "pydantic", "einops", "hjson", "triton")
               if importlib.util.find_spec(m) is None))
PY
)
if [ -n "$missing" ]; then
    echo "gpu_check: missing Python packages: $missing (pip install -e . or bash benchmarks/gpu_wheels.sh)"
fi
exec "$PY" benchmarks/gpu_check.py "$@"
