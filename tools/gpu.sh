#!/usr/bin/env bash
# SPDX-License-Identifier: GPL-3.0-or-later
# Run the GPU tests and benchmarks on a CUDA machine: copy the repository there and run, from the
# repository root,
#   bash tools/gpu.sh tests [pytest args]     the host tests against a real ComfyUI on the GPU
#                                             (CNA_TEST_GPU=1), e.g. tests/host tests/memory; on
#                                             a ComfyUI with DynamicVRAM, the tests marked
#                                             captures run a second time with it off.
#                                             The whole suite takes over 9 minutes with
#                                             -n 12 --dist loadfile -v (pytest-xdist) on a
#                                             16-core H200 machine: run it in slices, with -v so
#                                             that a run stopped early still names each result
#   bash tools/gpu.sh bench [benchmark args]  the quick benchmark (python benchmark.py), e.g.
#                                             --workloads W2 --variants stock,fused+graph
#   bash tools/gpu.sh kernels [args]          the kernel microbenchmark (benchmark.py --kernels)
#   bash tools/gpu.sh soak [soak args]        the soak: real ComfyUI servers, one per GPU, e.g.
#                                             --gpus 0,1 --prompts 200 --budget 480
#   bash tools/gpu.sh mem [args]              where a run's peak VRAM goes (--mem-breakdown)
#   bash tools/gpu.sh repro [N]               N fresh processes (default 4) each of W4 fused+graph
#                                             with concurrent and with serial ControlNets from a
#                                             cold start, reporting each exit code and any
#                                             "illegal memory access": a check of the graph
#                                             path's cross-stream memory ordering on SDXL
# docs/benchmarks.md gives the exact arguments of every published table.
#
# Environment:
#   COMFYUI_PATH    the ComfyUI tree to use (default: .comfy/ComfyUI in the repository root)
#   CNA_MODELS_DIR  where the generated random-weight models are cached (default /tmp/cna_models)
#   CNA_OUT         folder for the JSON and tables of bench, kernels, soak, mem and repro
#                   (default /tmp/cna-out)
#   CNA_TEST_MAX_RSS_GB  the tests' memory bound; 0 (off) here unless given: it is the CPU CI
#                   machine's bound, and on a GPU machine inductor's compile workers and the
#                   kernel builds run as the tests' children and count towards it
#   CNA_KERNELS     for tests and kernels, set to cuda here unless given: the pack's CUDA
#                   kernels run in every test, also before kernels/registry.py records them as
#                   validated. bench, soak, mem and repro keep the user's default (auto) unless
#                   given: cuda also puts the Memory Pool's INT8 Linear layers on the Triton
#                   kernel that auto leaves off, so their figures would not be the pack's defaults
# Wheels the machine lacks (e.g. torchsde, trampoline, av; comfyui-frontend-package, which the
# soak's servers need; diffusers, for bench --peers) can be put in .whl/: they are installed
# once per machine into /tmp/site (no index, no dependencies), under a lock so that two runs
# started at once do not race.
set -uo pipefail
OUT=${CNA_OUT:-/tmp/cna-out}
if compgen -G ".whl/*.whl" >/dev/null; then
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
export CNA_TEST_MAX_RSS_GB=${CNA_TEST_MAX_RSS_GB:-0}
what=${1:-}; shift || true
case "$what" in
  tests|kernels) export CNA_KERNELS=${CNA_KERNELS:-cuda} ;;
esac
case "$what" in
  tests)
    CNA_TEST_GPU=1 python3 -m pytest -q "$@"
    rc=$?
    # A ComfyUI with DynamicVRAM (0.33+) runs it on a GPU by default, and the CUDA Graph node
    # then runs eager: the tests marked `captures` skip in that run and run here, with it off.
    if [ -z "${CNA_DYNAMIC_VRAM:-}" ] && grep -q "disable-dynamic-vram" "$COMFYUI_PATH/comfy/cli_args.py" 2>/dev/null; then
      echo "== the tests marked captures again, with DynamicVRAM off (CNA_DYNAMIC_VRAM=0)"
      CNA_DYNAMIC_VRAM=0 CNA_TEST_GPU=1 python3 -m pytest -q -m captures "$@"
      r2=$?
      # 5: none of the chosen tests is marked captures, nothing to run again
      if [ $r2 -ne 0 ] && [ $r2 -ne 5 ]; then rc=1; fi
    fi
    exit $rc ;;
  bench) python3 benchmark.py --out "$OUT" "$@" ;;
  kernels) python3 benchmark.py --kernels --out "$OUT" "$@" ;;
  soak) python3 benchmark.py --soak --out "$OUT" "$@" ;;
  mem) python3 benchmark.py --mem-breakdown --out "$OUT" "$@" ;;
  repro)
    # one fresh process per attempt: such a fault aborts the process; the tally is the answer
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
