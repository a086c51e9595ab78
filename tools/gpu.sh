#!/usr/bin/env bash
# SPDX-License-Identifier: GPL-3.0-or-later
# Run on the lent GPU machine (the device tool), from the repository root, with `.comfy` (a
# ComfyUI tree) and `.whl` (wheels the machine lacks: torchsde, trampoline, av) carried along.
#   bash tools/gpu.sh tests [pytest args]     host tests on the GPU
#   bash tools/gpu.sh bench [benchmark args]  the quick benchmark, results under $OUT
#   bash tools/gpu.sh kernels                 the kernel microbenchmark, results under $OUT
# Next GPU session, in order (each fits one device call; see docs/benchmarks.md, "Still not
# measured", and the last closing note):
#   bash tools/gpu.sh tests -p no:cacheprovider -q tests/host tests/memory tests/graphs -rfE
#     (the badge instrumentation's GPU path, the final Memory Pool tests; then resolve #8)
#   bash tools/gpu.sh bench --workloads W1,W2,W4 --rounds 3 --no-profile --decode \
#     --variants stock,fused+graph,cache_every3+graph,cache_every4+graph,stack_all_cc
#     (the Feature Cache's whole-run mean after the store-pool fixes)
#   bash tools/gpu.sh bench --workloads W0,W3 --variants stock,cuda_graph,fused,fused+graph \
#     --cold-memory ; then W1 with compile_inductor,compile_cudagraphs (TorchCompileModel)
set -uo pipefail
OUT=${OUT:-/tmp/cna-out}
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
export COMFYUI_PATH=${COMFYUI_PATH:-$PWD/.comfy/ComfyUI}
export CNA_MODELS_DIR=${CNA_MODELS_DIR:-/tmp/cna_models}
export PYTHONUNBUFFERED=1
# The GPU machine is where the CUDA kernels get validated: always use them here, also while
# kernels/registry.py's VALIDATED_ON_GPU is False.
export CNA_KERNELS=${CNA_KERNELS:-cuda}
what=${1:-}; shift || true
case "$what" in
  tests) CNA_TEST_GPU=1 python3 -m pytest -q "$@" ;;
  bench) python3 benchmark.py --out "$OUT" "$@" ;;
  kernels) python3 benchmark.py --kernels --out "$OUT" "$@" ;;
  soak) python3 benchmark.py --soak --out "$OUT" "$@" ;;
  *) echo "usage: tools/gpu.sh tests|bench|kernels|soak [args]" >&2; exit 2 ;;
esac
