#!/usr/bin/env bash
# SPDX-License-Identifier: GPL-3.0-or-later
# Run on the lent GPU machine (the device tool), from the repository root, with `.comfy` (a
# ComfyUI tree) and `.whl` (wheels the machine lacks: torchsde, trampoline, av) carried along.
#   bash tools/gpu.sh tests [pytest args]     host tests on the GPU
#   bash tools/gpu.sh bench [benchmark args]  the quick benchmark, results under $OUT
#   bash tools/gpu.sh kernels                 the kernel microbenchmark, results under $OUT
#   bash tools/gpu.sh soak [soak args]        the soak run (real ComfyUI servers), under $OUT
# The soak's servers need comfyui-frontend-package on the GPU machine: keep its wheel in .whl.
# .whl (av + frontend) and .comfy together exceed the 64 MiB a call may carry; move the
# tokenizers SD1.5 does not use out of .comfy for that call (t5, qwen25, t5_pile, ace_lyrics,
# hydit_clip under comfy/text_encoders/) and put them back afterwards.
# Next GPU session, in order (see the last closing note):
#   bash tools/gpu.sh soak --gpus 0,1 --prompts 200 --budget 400      (kind nvidia-h200-x2;
#     the last try lost both servers, "connection refused": read soak-server-*.log first)
#   bash tools/gpu.sh tests -q tests/host/test_faults.py -rfE   (34 of 44 ran on the H200)
#   bash tools/gpu.sh bench --workloads W2 --rounds 3 --no-profile --decode \
#     --variants stock,fused+graph,cache_every4+graph,cache_every5+graph  (every 5: 1.41x predicted)
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
