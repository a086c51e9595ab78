#!/usr/bin/env bash
# SPDX-License-Identifier: GPL-3.0-or-later
# Run on the lent GPU machine (the device tool), from the repository root, with `.comfy` (a
# ComfyUI tree) and `.whl` (wheels the machine lacks: torchsde, trampoline, av) carried along.
#   bash tools/gpu.sh tests [pytest args]     host tests on the GPU
#   bash tools/gpu.sh bench [benchmark args]  the quick benchmark, results under $OUT
#   bash tools/gpu.sh kernels                 the kernel microbenchmark, results under $OUT
#   bash tools/gpu.sh soak [soak args]        the soak run (real ComfyUI servers), under $OUT
#   bash tools/gpu.sh mem [args]              where a run's peak VRAM goes, under $OUT
#   bash tools/gpu.sh repro [N]               session 6's W4 crash (fixed in session 7): N fresh
#                                             processes each of W4 fused+graph and _serial
# The soak's servers need comfyui-frontend-package on the GPU machine: keep its wheel in .whl.
# .whl (av + frontend) and .comfy together exceed the 64 MiB a call may carry; move the
# tokenizers SD1.5 does not use out of .comfy for that call (t5, qwen25, t5_pile, ace_lyrics,
# hydit_clip under comfy/text_encoders/) and put them back afterwards. Calls other than the soak
# do not need the frontend wheel: move it out of .whl for them instead (session 6 did).
# Next GPU session, in order (see the last closing note):
#   1. the host tests on the GPU, whole: bash tools/gpu.sh tests -q -rfE tests/host tests/memory
#      (session 7 ran test_cuda_graph.py's stream cases, test_memory_pool.py and tests/memory
#      before its last bookkeeping change; the small-layer counting is CPU-tested)
#   2. the crash's evidence, still counting (session 7: old code 1 abort in 3, fixed 0 in 2 and
#      none in 4 benchmark processes): bash tools/gpu.sh repro 3
#   3. W1's Memory Pool row (last measured in session 3):
#      bash tools/gpu.sh bench --workloads W1 --variants fused+graph,pool_int8_offload+graph \
#        --rounds 2 --no-profile --cold-memory
#   4. the soak again (kind nvidia-h200-x2) for the /free VRAM reading:
#      bash tools/gpu.sh soak --gpus 0,1 --prompts 200 --budget 480
set -uo pipefail
OUT=${OUT:-/tmp/cna-out}
if compgen -G ".whl/*.whl" >/dev/null; then
  # once per machine, under a lock: two of these started at once (a benchmark on one GPU, tests
  # on the other) raced here, and one of them lost torchsde half-way through the other's install
  (
    if command -v flock >/dev/null; then flock 9; fi
    [ -e /tmp/site/.cna-installed ] || {
      python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl && touch /tmp/site/.cna-installed
    }
  ) 9>/tmp/cna-site.lock
  export PYTHONPATH=/tmp/site
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
  mem) python3 benchmark.py --mem-breakdown --out "$OUT" "$@" ;;
  repro)
    # one fresh process per attempt (the crash aborted the process); the tally is the answer
    mkdir -p "$OUT/repro"
    for i in $(seq 1 "${1:-4}"); do
      for v in fused+graph fused+graph_serial; do
        python3 benchmark.py --out "$OUT/repro" --workloads W4 --variants "$v" --rounds 1 \
          --no-profile --cold-memory >"$OUT/repro/$v-$i.log" 2>&1
        echo "attempt $i $v: rc=$? $(grep -c 'illegal memory access' "$OUT/repro/$v-$i.log")"
      done
    done ;;
  *) echo "usage: tools/gpu.sh tests|bench|kernels|soak|mem|repro [args]" >&2; exit 2 ;;
esac
