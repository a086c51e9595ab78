# SPDX-License-Identifier: GPL-3.0-or-later
"""The quick benchmark: stock ComfyUI and each technique, interleaved in one process.

For each workload: generate (once) and load the random-weight models; prime stock (loads weights,
encodes the prompts); run each variant once cold (first-run overhead: JIT build, graph capture,
cache warm-up); then ``rounds`` rounds in which every variant runs on the same seed, one after
the other, so host drift hits all variants alike; then one 20-step and one 10-step profiled run
per variant on a GPU (their difference / 10 is the GPU-busy time and kernel launches per step).
Prints a table, writes JSON and Markdown beside it. docs/benchmarks.md describes the method.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

GPU_WORKLOADS = ["W0", "W1", "W2", "W3", "W4", "W5"]
GPU_ROUNDS = 3
# On a CPU the benchmark is a functional check (graphs run eager there, and the tiny models say
# nothing about speed on a real model): the two-ControlNet workload on the tiny SD1.5-layout
# models, one warm round, so that it ends in a couple of minutes on two cores.
CPU_WORKLOADS = ["T2"]
CPU_ROUNDS = 1
MiB = 1024 * 1024


def _insert_model_node(class_type: str, **inputs) -> Callable[[dict, dict], None]:
    """A variant that puts one MODEL -> MODEL node between the checkpoint and the sampler."""

    def extra(p: dict, ids: dict) -> None:
        nid = str(max(int(k) for k in p) + 1)
        model_in = p[ids["sampler"]]["inputs"]["model"]  # after any earlier MODEL node
        p[nid] = {"class_type": class_type, "inputs": {"model": model_in, **inputs}}
        p[ids["sampler"]]["inputs"]["model"] = [nid, 0]
        ids[class_type] = nid

    return extra


def _fused_apply(p: dict, ids: dict) -> None:
    """Swap every stock Apply ControlNet for Apply ControlNet (Fused): same inputs."""
    for node in p.values():
        if node["class_type"] == "ControlNetApplyAdvanced":
            node["class_type"] = "CNA_ControlNetApplyFused"


def _feature_cache(**inputs) -> Callable[[dict, dict], None]:
    """Put a ControlNet Feature Cache node after every ControlNet loader."""

    def extra(p: dict, ids: dict) -> None:
        # imported here, not when the variants are defined: importing torch before the host
        # starts would keep PyTorch's native allocator instead of ComfyUI's cudaMallocAsync
        import dataclasses

        from ..memory.feature_cache import CacheConfig

        all_inputs = {**dataclasses.asdict(CacheConfig()), **inputs}  # every input, defaults
        loaders = [k for k in ids if k.startswith("cn_")]
        for key in loaders:
            nid = str(max(int(k) for k in p) + 1)
            p[nid] = {
                "class_type": "CNA_ControlNetFeatureCache",
                "inputs": {"control_net": [ids[key], 0], **all_inputs},
            }
            for node in p.values():
                if node["inputs"].get("control_net") == [ids[key], 0] and node is not p[nid]:
                    node["inputs"]["control_net"] = [nid, 0]
            ids[f"cache_{key}"] = nid

    return extra


def _chain(*extras: Callable[[dict, dict], None]) -> Callable[[dict, dict], None]:
    def extra(p: dict, ids: dict) -> None:
        for e in extras:
            e(p, ids)

    return extra


# A variant rewires the stock prompt in place: extra(prompt, ids). ``None`` is stock ComfyUI.
VARIANTS: dict[str, Callable[[dict, dict], None] | None] = {
    "stock": None,
    # max_graphs 24: the variants of one run share the model's graph cache; 8 would make the
    # Feature Cache variants (two graphs each) evict one another and recapture every round.
    "cuda_graph": _insert_model_node("CNA_CUDAGraph", enabled=True, max_graphs=24, verify=False),
    "fused": _fused_apply,
}
VARIANTS["fused+graph"] = _chain(_fused_apply, VARIANTS["cuda_graph"])


def _positive_only(p: dict, ids: dict) -> None:
    """Fused apply with its positive_only option on."""
    _fused_apply(p, ids)
    for node in p.values():
        if node["class_type"] == "CNA_ControlNetApplyFused":
            node["inputs"]["positive_only"] = True


VARIANTS["fused_positive_only+graph"] = _chain(_positive_only, VARIANTS["cuda_graph"])
# Experimental: channels-last convolution weights during sampling (nodes/channels_last.py).
VARIANTS["cuda_graph_cl"] = _insert_model_node(
    "CNA_CUDAGraph", enabled=True, max_graphs=24, verify=False, channels_last=True
)
# ControlNets on a second stream inside the graph, beside the UNet's input blocks: the node's
# default (so "cuda_graph"/"fused+graph" have it too); "_serial" turns it off.
VARIANTS["fused+graph_serial"] = _chain(
    _fused_apply,
    _insert_model_node(
        "CNA_CUDAGraph", enabled=True, max_graphs=24, verify=False, concurrent_controlnet=False
    ),
)
VARIANTS["fused+graph_cc"] = _chain(
    _fused_apply,
    _insert_model_node(
        "CNA_CUDAGraph", enabled=True, max_graphs=24, verify=False, concurrent_controlnet=True
    ),
)
# The Feature Cache, alone and on top of graphs + fused apply.
for _n in (2, 3, 4, 5):
    VARIANTS[f"cache_every{_n}+graph"] = _chain(
        _feature_cache(mode="every_n", every_n=_n, max_reuse=_n - 1),
        _fused_apply,
        VARIANTS["cuda_graph"],
    )
for _th in (0.1, 0.2, 0.3):
    VARIANTS[f"cache_adaptive{_th}+graph"] = _chain(
        _feature_cache(mode="adaptive", threshold=_th, max_reuse=3),
        _fused_apply,
        VARIANTS["cuda_graph"],
    )
VARIANTS["cache_every2"] = _feature_cache(mode="every_n", every_n=2, max_reuse=1)
VARIANTS["cache_every2_fp16+graph"] = _chain(
    _feature_cache(mode="every_n", every_n=2, max_reuse=1, storage="fp16"),
    _fused_apply,
    VARIANTS["cuda_graph"],
)


def _memory_pool(**inputs) -> Callable[[dict, dict], None]:
    """One ControlNet Memory Pool per ControlNet loader, chained on the MODEL (with no
    ControlNet, one for the model alone); the sampler gets the last one's model."""

    def extra(p: dict, ids: dict) -> None:
        import dataclasses  # (imported late: see _feature_cache)

        from ..nodes.memory_pool import PoolOptions

        loaders = sorted(k for k in ids if k.startswith("cn_")) or [None]
        model_src = p[ids["sampler"]]["inputs"]["model"]
        for key in loaders:
            nid = str(max(int(k) for k in p) + 1)
            node = {"class_type": "CNA_ControlNetMemoryPool", "inputs": {"model": model_src}}
            node["inputs"].update({**dataclasses.asdict(PoolOptions()), **inputs})
            if key is not None:
                node["inputs"]["control_net"] = [ids[key], 0]
                for other in p.values():
                    if other["inputs"].get("control_net") == [ids[key], 0]:
                        other["inputs"]["control_net"] = [nid, 1]
            p[nid] = node
            model_src = [nid, 0]
            ids[f"pool_{key}"] = nid
        p[ids["sampler"]]["inputs"]["model"] = model_src

    return extra


# Memory Pool levers: INT8 weights of the UNet and the ControlNets, idle models unloaded.
VARIANTS["pool_int8"] = _memory_pool()
VARIANTS["pool_int8_offload"] = _memory_pool(offload_idle_models=True)
VARIANTS["pool_cn_int8"] = _memory_pool(unet_weights="as loaded")
VARIANTS["pool_offload"] = _memory_pool(
    unet_weights="as loaded", controlnet_weights="as loaded", offload_idle_models=True
)
VARIANTS["pool_int8_offload+graph"] = _chain(
    VARIANTS["pool_int8_offload"], _fused_apply, VARIANTS["cuda_graph"]
)
# lossless: ControlNet weights streamed from pinned RAM (UNet as loaded, or INT8)
VARIANTS["pool_cn_stream+graph"] = _chain(
    _memory_pool(unet_weights="as loaded", controlnet_weights="stream", offload_idle_models=True),
    _fused_apply,
    VARIANTS["cuda_graph"],
)
VARIANTS["pool_int8_cn_stream+graph"] = _chain(
    _memory_pool(controlnet_weights="stream", offload_idle_models=True),
    _fused_apply,
    VARIANTS["cuda_graph"],
)
# INT8 with the ControlNets run after, not beside, the UNet's first blocks (less memory at once)
VARIANTS["pool_int8_offload+graph_serial"] = _chain(
    VARIANTS["pool_int8_offload"],
    VARIANTS["fused+graph_serial"],
)
# everything streamed: UNet and ControlNets in pinned RAM (the least VRAM, exact, slowest)
VARIANTS["pool_stream_all"] = _memory_pool(
    unet_weights="stream", controlnet_weights="stream", offload_idle_models=True
)
VARIANTS["pool_cn_stream"] = _memory_pool(
    unet_weights="as loaded", controlnet_weights="stream", offload_idle_models=True
)
# Every node in its exact mode (Memory Pool weights as loaded + idle models unloaded, Feature
# Cache off, fused apply, graphs with concurrent ControlNets): must give stock's result.
VARIANTS["exact_stack"] = _chain(
    _memory_pool(
        unet_weights="as loaded", controlnet_weights="as loaded", offload_idle_models=True
    ),
    _feature_cache(mode="off"),
    _fused_apply,
    VARIANTS["cuda_graph"],
)
# Everything at once: positive-only fused apply, Feature Cache every 3, graphs with channels_last.
VARIANTS["stack_all"] = _chain(
    _feature_cache(mode="every_n", every_n=3, max_reuse=2),
    _positive_only,
    VARIANTS["cuda_graph_cl"],
)
VARIANTS["stack_all_cc"] = _chain(
    _feature_cache(mode="every_n", every_n=3, max_reuse=2),
    _positive_only,
    _insert_model_node(
        "CNA_CUDAGraph",
        enabled=True,
        max_graphs=24,
        verify=False,
        channels_last=True,
        concurrent_controlnet=True,
    ),
)
# The CUDA Graph node's compiled mode: the step's function compiled by torch.compile (Inductor)
# before capture. A version of the node without the ``compile`` input reports these as not run.
VARIANTS["graph_compiled"] = _insert_model_node(
    "CNA_CUDAGraph", enabled=True, max_graphs=24, verify=False, compile="inductor"
)
VARIANTS["fused+graph_compiled"] = _chain(_fused_apply, VARIANTS["graph_compiled"])
# The node's other compile choice: inductor's max-autotune (several kernels tried per GEMM and
# convolution on a shape's first compile). max_graphs 21: an input unlike the other variants'.
VARIANTS["graph_compiled_autotune"] = _insert_model_node(
    "CNA_CUDAGraph", enabled=True, max_graphs=21, verify=False, compile="inductor max-autotune"
)
# Environment settings a variant runs under (set for each of its runs, put back after): a switch
# that is on by default, compared with it off side by side in one process.
VARIANT_ENV: dict[str, dict[str, str]] = {}
# Compiled mode with each feed-forward projection and its GEGLU as one matrix multiply of the
# pack's (CNA_COMPILE_GEGLU=1, opt-in; off, every GEGLU is inductor's). max_graphs 13, not 24: an
# input must differ from graph_compiled's, or ComfyUI would answer the prompt from its output
# cache without sampling.
VARIANTS["graph_compiled_geglu_kernel"] = _insert_model_node(
    "CNA_CUDAGraph", enabled=True, max_graphs=13, verify=False, compile="inductor"
)
VARIANT_ENV["graph_compiled_geglu_kernel"] = {"CNA_COMPILE_GEGLU": "1"}
# ... and with the ControlNets before the UNet on one stream (concurrent_controlnet off), against
# graph_compiled_serial: the kernel without another stream's kernels beside it. max_graphs 12.
VARIANTS["graph_compiled_geglu_kernel_serial"] = _insert_model_node(
    "CNA_CUDAGraph",
    enabled=True,
    max_graphs=12,
    verify=False,
    compile="inductor",
    concurrent_controlnet=False,
)
VARIANT_ENV["graph_compiled_geglu_kernel_serial"] = {"CNA_COMPILE_GEGLU": "1"}
# Compiled mode with dynamic shapes: one compile for every size (max_graphs 22: an input that
# differs from the other compiled variants', as above).
VARIANTS["graph_compiled_dynamic"] = _insert_model_node(
    "CNA_CUDAGraph", enabled=True, max_graphs=22, verify=False, compile="inductor"
)
VARIANT_ENV["graph_compiled_dynamic"] = {"CNA_COMPILE_DYNAMIC": "1"}
# Compiled mode with each attention on the SDPA backend measured fastest for its shapes instead
# of ComfyUI's first choice (max_graphs 20: an input that differs, as above).
VARIANTS["graph_compiled_attention"] = _insert_model_node(
    "CNA_CUDAGraph", enabled=True, max_graphs=20, verify=False, compile="inductor"
)
VARIANT_ENV["graph_compiled_attention"] = {"CNA_COMPILE_ATTENTION": "fastest"}
# Compiled mode with every attention on ComfyUI's own first choice (the choice off; by default
# it runs for the attentions ComfyUI puts on flash attention first). max_graphs 19, as above.
VARIANTS["graph_compiled_comfy_attention"] = _insert_model_node(
    "CNA_CUDAGraph", enabled=True, max_graphs=19, verify=False, compile="inductor"
)
VARIANT_ENV["graph_compiled_comfy_attention"] = {"CNA_COMPILE_ATTENTION": "off"}
# Compiled mode with inductor's settings of diffusers' SD recipe (CNA_COMPILE_TUNING=1: 1x1
# convolutions as matrix multiplies, kernel configurations tuned on the first run). max_graphs 18.
VARIANTS["graph_compiled_tuned"] = _insert_model_node(
    "CNA_CUDAGraph", enabled=True, max_graphs=18, verify=False, compile="inductor"
)
VARIANT_ENV["graph_compiled_tuned"] = {"CNA_COMPILE_TUNING": "1"}
# Compiled mode with the ControlNets before the UNet on one stream (concurrent_controlnet off;
# on, the default, they run beside it).
VARIANTS["graph_compiled_serial"] = _insert_model_node(
    "CNA_CUDAGraph",
    enabled=True,
    max_graphs=24,
    verify=False,
    compile="inductor",
    concurrent_controlnet=False,
)
# Compiled mode with dynamo resuming the graph break at the ControlNets' wait inside the UNet's
# frame that waits (CNA_COMPILE_NESTED_BREAKS=1; off, it traces the enclosing frames again).
# max_graphs 17, as above.
VARIANTS["graph_compiled_nested"] = _insert_model_node(
    "CNA_CUDAGraph", enabled=True, max_graphs=17, verify=False, compile="inductor"
)
VARIANT_ENV["graph_compiled_nested"] = {"CNA_COMPILE_NESTED_BREAKS": "1"}
# The exact graphs with the text context's key and value projections run at every step, as
# before they ran once per context (CNA_CONTEXT_HOIST=0). max_graphs 23: a node of its own.
VARIANTS["cuda_graph_context_every_step"] = _insert_model_node(
    "CNA_CUDAGraph", enabled=True, max_graphs=23, verify=False
)
VARIANT_ENV["cuda_graph_context_every_step"] = {"CNA_CONTEXT_HOIST": "0"}
# ... and with them once per context (CNA_CONTEXT_HOIST=1). max_graphs 22.
VARIANTS["cuda_graph_context_once"] = _insert_model_node(
    "CNA_CUDAGraph", enabled=True, max_graphs=22, verify=False
)
VARIANT_ENV["cuda_graph_context_once"] = {"CNA_CONTEXT_HOIST": "1"}
# Compiled mode with the context projections lifted out of the compiled code and run once per
# context (CNA_CONTEXT_HOIST=1; compiled mode does so by default, so this is graph_compiled as a
# node of its own). max_graphs 16.
VARIANTS["graph_compiled_context_once"] = _insert_model_node(
    "CNA_CUDAGraph", enabled=True, max_graphs=16, verify=False, compile="inductor"
)
VARIANT_ENV["graph_compiled_context_once"] = {"CNA_CONTEXT_HOIST": "1"}
# ... and with them inside the compiled code, run at every step (CNA_CONTEXT_HOIST=0), against
# graph_compiled's default. max_graphs 15.
VARIANTS["graph_compiled_context_every_step"] = _insert_model_node(
    "CNA_CUDAGraph", enabled=True, max_graphs=15, verify=False, compile="inductor"
)
VARIANT_ENV["graph_compiled_context_every_step"] = {"CNA_CONTEXT_HOIST": "0"}
# Compiled mode with the UNet's wait for the ControlNets' stream as a call dynamo does not trace
# (CNA_COMPILE_TRACED_JOIN=0: the UNet's compiled code in parts around it), against
# graph_compiled's default, the wait as an op of one graph. max_graphs 14.
VARIANTS["graph_compiled_untraced_join"] = _insert_model_node(
    "CNA_CUDAGraph", enabled=True, max_graphs=14, verify=False, compile="inductor"
)
VARIANT_ENV["graph_compiled_untraced_join"] = {"CNA_COMPILE_TRACED_JOIN": "0"}
# ComfyUI's own compile node, for comparison (compiles the UNet only; slow first run).
VARIANTS["compile_inductor"] = _insert_model_node("TorchCompileModel", backend="inductor")
VARIANTS["compile_cudagraphs"] = _insert_model_node("TorchCompileModel", backend="cudagraphs")
DEFAULT_VARIANTS = ["stock", "cuda_graph", "fused", "fused+graph"]


@contextlib.contextmanager
def variant_env(variant: str):
    """The variant's ``VARIANT_ENV`` settings for the block; the previous values after it."""
    env = VARIANT_ENV.get(variant, {})
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


# Compiled mode's figures the first run's row keeps (from the CUDA Graph node's badge)
COMPILE_KEYS = ("compiles", "compile_s", "backend_s")

# diffusers' pipeline with torch.compile as its users run it: CUDA graphs (reduce-overhead),
# and inductor's tuned kernels without them
PEER_MODES = ("reduce-overhead", "max-autotune-no-cudagraphs")

# Kernel-name patterns -> op kind, for --op-profile (first match wins; names are lowercased).
OP_KINDS = [
    # the pack's matrix multiply with the GEGLU in its epilogue (kernels/geglu_linear.py)
    ("gemm+geglu", ("geglu_kernel",)),
    ("attention", ("flash", "fmha", "attention", "sdpa", "softmax")),
    ("groupnorm", ("group_norm", "groupnorm", "rowwisemoments", "computefusedparams", "gn_")),
    ("layernorm", ("layer_norm", "layernorm")),
    # cuDNN's NCHW<->NHWC conversions around each fp16 conv (Hopper kernels are NHWC).
    ("conv layout", ("nchwtonhwc", "nhwctonchw")),
    ("conv", ("conv", "cudnn", "fprop", "dgrad", "implicit", "winograd")),
    ("gemm", ("gemm", "cutlass", "cublas", "xmma", "matmul", "nvjet")),
    ("silu/gelu", ("silu", "gelu", "sigmoid")),
    ("copy/cat/layout", ("copy", "cat", "memcpy", "memset", "transpose", "permute", "contiguous")),
    ("elementwise", ("elementwise", "add", "mul", "div", "sub", "fill", "where", "clamp")),
    ("reduce", ("reduce", "mean", "sum", "max")),
]


def op_kind(name: str) -> str:
    n = name.lower()
    for kind, pats in OP_KINDS:
        if any(p in n for p in pats):
            return kind
    return "other"


@dataclass
class Row:
    workload: str
    variant: str
    ms_step_median: float
    # mean of the per-step times (median over rounds): what a run costs when steps differ, as
    # with the Feature Cache (compute and reuse steps alternate; their median is one or the
    # other). Includes any capture inside the run.
    ms_step_mean: float
    ms_step_min: float
    ms_step_max: float
    run_medians_ms: list[float]
    wall_s_median: float
    first_run_s: float
    first_run_overhead_s: float
    psnr_vs_stock_db: float | None
    gpu_busy_ms_step: float | None = None
    launches_step: float | None = None
    # CPU time per step in the CUDA Graph node's wrappers (median over rounds; graph variants)
    host_ms_step: float | None = None
    launch_ms_step: float | None = None
    host_ms_replay: float | None = None
    peak_allocated_mib: float | None = None
    peak_reserved_mib: float | None = None
    resident_mib: float | None = None
    extra: dict = field(default_factory=dict)


class Progress:
    """One line on stderr, rewritten in place: where the benchmark is and how far it has come."""

    def __init__(self, total: int):
        self.total, self.done, self.t0 = total, 0, time.perf_counter()
        # variants that did not run, per workload, with the reason: written beside the rows
        self.not_run: list[dict] = []
        self.tty = sys.stderr.isatty()

    def step(self, what: str) -> None:
        self.done += 1
        el = time.perf_counter() - self.t0
        msg = f"[{self.done}/{self.total}] {el:6.1f}s  {what}"
        if self.tty:
            sys.stderr.write("\r\033[K" + msg)
        else:
            sys.stderr.write(msg + "\n")
        sys.stderr.flush()

    def note(self, msg: str) -> None:
        sys.stderr.write(("\r\033[K" if self.tty else "") + msg + "\n")
        sys.stderr.flush()

    def close(self) -> None:
        if self.tty:
            sys.stderr.write("\n")


def run_settings() -> dict:
    """The pack's switches this run was started with: its kernel mode (``CNA_KERNELS``, as the
    registry read it) and every other ``CNA_`` variable that is a setting, not a folder or a
    program (a value with a path separator is left out). A variant's own settings
    (``VARIANT_ENV``) are set around its runs only and are not among them."""
    from ..kernels import registry

    out = {
        k: v
        for k, v in sorted(os.environ.items())
        if k.startswith("CNA_") and "/" not in v and os.sep not in v
    }
    out["CNA_KERNELS"] = registry.mode()
    # Whether the extension's ops run on their CUDA kernels by default, and why not: a run whose
    # kernel sources are not the validated ones measures their PyTorch path.
    cuda = {b["name"]: b for b in registry.list_backends()}["cuda"]
    out["cuda_kernels_by_default"] = bool(cuda.get("used_by_default"))
    if cuda.get("reason") or cuda.get("note"):
        out["cuda_kernels_note"] = cuda.get("reason") or cuda.get("note")
    return out


def environment() -> dict:
    import torch

    env = {
        "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "host": platform.node(),
        "cpu_count": os.cpu_count(),
        "allocator": (
            torch.cuda.memory.get_allocator_backend() if torch.cuda.is_available() else "n/a (CPU)"
        ),
    }
    env["settings"] = run_settings()
    try:
        import comfyui_version

        env["comfyui"] = comfyui_version.__version__
    except ImportError:
        env["comfyui"] = "unknown"
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name()
        try:
            import subprocess

            env["driver"] = subprocess.run(
                ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                timeout=20,
            ).stdout.strip()
        except Exception:
            env["driver"] = "unknown"
    return env


def run_workload(
    wid: str,
    variants: list[str],
    rounds: int,
    profile: bool,
    steps: int | None,
    models_dir: Path,
    prog: Progress,
    op_profile: bool = False,
    decode: bool = False,
    cold_memory: bool = False,
    peers: tuple[str, ...] = (),
    compile_phases: bool = False,
) -> list[Row]:
    """Stock ComfyUI, each variant and each peer (``peers``: diffusers with these compile
    modes, ``--peers``) on one workload, interleaved round by round in this process.
    ``compile_phases``: each first run's compile time by phase (``compile_phases.py``)."""
    import folder_paths
    import torch

    from . import badges, random_models, runner, workflows
    from . import compile_phases as cp

    wl = workflows.WORKLOADS[wid]
    if steps is not None:
        wl = wl.with_(steps=steps)
    if decode:
        wl = wl.with_(decode=True)

    def report(name, done, total):
        prog.note(f"  generating {name}: {100 * done / total:5.1f}%") if done == total else None

    random_models.ensure_models(wl.models(), models_dir, progress=report, log=prog.note)
    hints = workflows.write_hint_images(folder_paths.get_input_directory(), wl)
    r = runner.Runner()

    def run(variant: str, seed: int, *, steps_override=None, prof=False):
        w = wl if steps_override is None else wl.with_(steps=steps_override)
        p, ids = workflows.build_prompt(w, seed, hints, VARIANTS[variant])
        with variant_env(variant):
            res = badges.run(r, p, ids, profile=prof)
        if badges.data(res, "cuda_graph"):  # the run's own figures, from the nodes' badges
            res.extra["graph_steps"] = badges.graph_counts(res)
        elif _graph_node_passed_model_on(r, p, ids):
            # the node did not run (ComfyUI reused its output from an earlier prompt with the
            # same inputs), and that output is its input model: handed on unchanged
            res.extra["graph_node_reused_pass_through"] = True
        if badges.data(res, "feature_cache"):
            res.extra["cache_calls"] = badges.summed(
                res, "feature_cache", ("computed", "reused"), sub="calls"
            )
        return res

    prime = run("stock", 1000)
    prog.step(f"{wid} primed (load + encode) in {prime.wall_s:.1f}s")
    variants = list(variants)
    # A variant whose prompt equals an earlier one's on this workload (positive-only without a
    # ControlNet, say) would be answered from ComfyUI's output cache without sampling.
    seen: dict[str, str] = {}
    for v in list(variants):
        p, _ = workflows.build_prompt(wl, 1001, hints, VARIANTS[v])
        key = json.dumps(p, sort_keys=True)
        unknown = unknown_inputs(p)
        if unknown:  # ComfyUI would pass them on to the node, which would refuse them
            _not_run(wid, v, "failed: " + "; ".join(unknown), variants, prog)
        elif key in seen:
            _not_run(wid, v, f"same prompt as {seen[key]} on this workload", variants, prog)
        else:
            seen[key] = v
    first: dict[str, float] = {}
    first_compile: dict[str, dict] = {}  # compiled mode's compiles in the first run
    phases: dict[str, dict] = {}  # --compile-phases: torch's compile timers, per first run
    for v in list(variants):
        before = cp.snapshot() if compile_phases else None
        try:
            res = run(v, 1001)
        except runner.WorkflowFailed as e:
            _not_run(wid, v, f"failed: {e}", variants, prog)
            continue
        if before is not None:
            phases[v] = cp.delta(before, cp.snapshot())
        first[v] = res.wall_s
        comp = badges.summed(res, "cuda_graph", COMPILE_KEYS, sub="compiled")
        said = ""
        if comp["compiles"]:
            first_compile[v] = comp
            said = (
                f" ({comp['compiles']} compile(s): {comp['backend_s']:.1f} s compiling graphs "
                f"or reading the cache, {comp['compile_s'] - comp['backend_s']:.1f} s tracing "
                "and first runs)"
            )
        prog.step(f"{wid} {v} first run {first[v]:.2f}s{said}")
    per_run: dict[str, list] = {v: [] for v in variants}
    peer_of, sigmas = _start_peers(wl, peers, models_dir, r.cuda, first, prog)
    per_run.update({name: [] for name in peer_of})
    for k in range(rounds):
        stock_latent = stock_image = None
        for v in list(variants):
            try:
                res = run(v, 2000 + k)
            except runner.WorkflowFailed as e:
                _not_run(wid, v, f"failed in round {k + 1}: {e}", variants, prog)
                per_run.pop(v)
                continue
            if v == "stock":
                stock_latent, stock_image = res.latent, res.image
            per_run[v].append(res)
            prog.step(
                f"{wid} {v} round {k + 1}/{rounds}: {statistics.median(res.step_ms):.2f} ms/step"
            )
        for name, peer in list(peer_of.items()):
            try:
                res = peer.run(2000 + k, sigmas)
            except Exception as e:  # as a failing variant: listed with the reason, rest go on
                peer.close()
                del peer_of[name], per_run[name]
                prog.not_run.append(
                    {"workload": wid, "variant": name, "why": f"failed in round {k + 1}: {e}"[:600]}
                )
                prog.note(f"{wid} {name} not run: failed in round {k + 1}: {str(e)[:300]}")
                continue
            per_run[name].append(res)
            prog.step(
                f"{wid} {name} round {k + 1}/{rounds}: {statistics.median(res.step_ms):.2f} ms/step"
            )
        for v in per_run:
            ref = stock_latent if stock_latent is not None else None
            per_run[v][-1].extra["psnr"] = (
                runner.psnr(ref, per_run[v][-1].latent) if ref is not None else None
            )
            img = getattr(per_run[v][-1], "image", None)
            if stock_image is not None and img is not None:
                per_run[v][-1].extra["image_psnr"] = runner.psnr(stock_image, img)
                per_run[v][-1].extra["ssim"] = runner.ssim(stock_image, img)
    cold: dict = {}
    if cold_memory and r.cuda:
        # Peak VRAM as a fresh ComfyUI sees it: nothing loaded, nothing cached (the text encoder
        # loads to encode the prompt, as in a first run), no graphs or caches of other variants.
        for v in variants:
            _cold_reset()
            w = wl.with_(decode=False)
            p, ids = workflows.build_prompt(w, 5000, hints, VARIANTS[v])
            with variant_env(v):
                cold[v] = runner.Runner(device_peak=True).run(p, ids)
            sp = cold[v].extra.get("sampling_peak_allocated", 0) / MiB
            prog.step(
                f"{wid} {v} cold: peak {cold[v].peak_allocated / MiB:.0f} MiB allocated "
                f"({sp:.0f} in sampling), {cold[v].peak_reserved / MiB:.0f} MiB reserved"
            )
        _cold_reset()
    busy: dict[str, tuple] = {}
    op_prof: dict[str, dict] = {}
    if op_profile and r.cuda:
        for v in variants:
            a = run(v, 4000, prof=True)
            b = run(v, 4001, steps_override=max(1, wl.steps // 2), prof=True)
            n = wl.steps - max(1, wl.steps // 2)
            kinds: dict[str, float] = {}
            for name, ms in a.extra["kernel_ms"].items():
                kinds[op_kind(name)] = kinds.get(op_kind(name), 0.0) + ms
            for name, ms in b.extra["kernel_ms"].items():
                kinds[op_kind(name)] = kinds.get(op_kind(name), 0.0) - ms
            top = sorted(((ms, name) for name, ms in a.extra["kernel_ms"].items()), reverse=True)
            op_prof[v] = {
                "ms_per_step_by_kind": {
                    k: round(x / n, 4) for k, x in sorted(kinds.items(), key=lambda kv: -kv[1])
                },
                # enough kernels to see past the big ones (inductor names a kernel after the
                # ops it came from, so a weight copy can carry a convolution's name)
                "top_kernels_ms_20_steps": [[nm, round(ms, 3)] for ms, nm in top[:80]],
            }
            prog.step(
                f"{wid} {v} op profile: "
                + ", ".join(
                    f"{k} {x:.2f}" for k, x in list(op_prof[v]["ms_per_step_by_kind"].items())[:5]
                )
            )
    if profile and r.cuda:
        for v in variants:
            a = run(v, 3000, prof=True)
            b = run(v, 3001, steps_override=max(1, wl.steps // 2), prof=True)
            n = wl.steps - max(1, wl.steps // 2)
            busy[v] = ((a.gpu_busy_ms - b.gpu_busy_ms) / n, (a.kernels - b.kernels) / n)
            prog.step(
                f"{wid} {v} profiled: {busy[v][0]:.2f} GPU-ms/step, {busy[v][1]:.0f} launches/step"
            )
        for name, peer in peer_of.items():
            busy[name] = _peer_busy(peer, wl, sigmas)
            prog.step(f"{wid} {name} profiled: {busy[name][0]:.2f} GPU-ms/step")

    rows = []
    for v in variants:
        runs = per_run[v]
        row = _timed_row(wid, v, runs, first[v])
        if r.cuda:
            row.peak_allocated_mib = max(x.peak_allocated for x in runs) / MiB
            row.peak_reserved_mib = max(x.peak_reserved for x in runs) / MiB
            row.resident_mib = statistics.median(x.resident_bytes for x in runs) / MiB
            used = [x.extra["device_used_end"] for x in runs if "device_used_end" in x.extra]
            if used:  # the process's device memory after the warm rounds: every model held
                row.extra["device_used_end_mib"] = max(used) / MiB
        if v in busy:
            row.gpu_busy_ms_step, row.launches_step = busy[v]
        if v in op_prof:
            row.extra["op_profile"] = op_prof[v]
        if v in first_compile:
            row.extra["first_run_compile"] = first_compile[v]
        if phases.get(v, {}).get("times"):
            row.extra["compile_phases"] = phases[v]
        if v in cold:
            row.extra["cold_peak_allocated_mib"] = cold[v].peak_allocated / MiB
            row.extra["cold_peak_reserved_mib"] = cold[v].peak_reserved / MiB
            sa = cold[v].extra.get("sampling_peak_allocated")
            if sa is not None:
                row.extra["cold_sampling_peak_allocated_mib"] = sa / MiB
                row.extra["cold_sampling_peak_reserved_mib"] = (
                    cold[v].extra["sampling_peak_reserved"] / MiB
                )
            sd = cold[v].extra.get("sampling_peak_device")
            if sd is not None:  # the device's used memory: sees DynamicVRAM's weights too
                row.extra["cold_sampling_peak_device_mib"] = sd / MiB
        row.extra["latent_std"] = float(runs[-1].latent.std())
        row.extra["step_ms_last_round"] = [round(x, 3) for x in runs[-1].step_ms]
        if any("ssim" in x.extra for x in runs):  # decoded images vs stock, worst round
            row.extra["ssim_vs_stock"] = min(x.extra["ssim"] for x in runs)
            row.extra["image_psnr_vs_stock_db"] = min(x.extra["image_psnr"] for x in runs)
        calls = runs[-1].extra.get("cache_calls")
        if calls and calls["computed"] + calls["reused"] > 0:
            row.extra["controlnet_calls"] = calls  # last round: network calls run vs reused
        steps_g = [x.extra["graph_steps"] for x in runs if "graph_steps" in x.extra]
        if steps_g:
            row.extra["graph_steps"] = steps_g[-1]  # last round: model calls replayed, ...
            graph = [d for x in runs for d in badges.data(x, "cuda_graph")]
            host_ms = [d["host_ms_per_step"] for d in graph if "host_ms_per_step" in d]
            if host_ms:  # CPU time in the pack's wrappers per step (ComfyUI's model excluded)
                row.host_ms_step = statistics.median(host_ms)
            per_replay = [d["host_ms_per_replay"] for d in graph if "host_ms_per_replay" in d]
            if per_replay:  # the same in the calls that replayed a graph: the per-step cost
                row.host_ms_replay = statistics.median(per_replay)
            launch = [d["launch_ms_per_step"] for d in graph if "launch_ms_per_step" in d]
            if launch:  # host time blocked in the graph launch per step (waiting for the GPU)
                row.launch_ms_step = statistics.median(launch)
                row.extra["plans_built"] = [d.get("plans_built") for d in graph]
        if (
            uses_graphs(v)
            and not steps_g
            and any(x.extra.get("graph_node_reused_pass_through") for x in runs)
        ):
            row.extra["passed_through"] = (
                "the CUDA Graph node's output was reused from an earlier variant's prompt: the "
                "model handed on unchanged"
            )
        if uses_graphs(v) and steps_g and not any(g["replays"] for g in steps_g):
            graph = [d for x in runs for d in badges.data(x, "cuda_graph")]
            passed = sorted({d["passed_through"] for d in graph if "passed_through" in d})
            if passed:  # the node handed the model on unchanged (DynamicVRAM): stock's model ran
                row.extra["passed_through"] = eager_note(passed)
            else:
                reasons = sorted({r for d in graph for r in d.get("eager_reasons", [])})
                row.extra["ran_eager"] = eager_note(reasons)
        row.extra["finite"] = bool(torch.isfinite(runs[-1].latent).all())
        rows.append(row)
    for name, peer in peer_of.items():
        runs = per_run[name]
        row = _timed_row(wid, name, runs, first[name])
        if name in busy:
            row.gpu_busy_ms_step, row.launches_step = busy[name]
        row.extra["compile_s"] = peer.compile_s
        row.extra["peer"] = f"diffusers {sys.modules['diffusers'].__version__}"
        row.extra["latent_std"] = float(runs[-1].latent.std())
        row.extra["step_ms_last_round"] = [round(x, 3) for x in runs[-1].step_ms]
        row.extra["finite"] = bool(torch.isfinite(runs[-1].latent).all())
        rows.append(row)
        peer.close()
    import comfy.model_management

    comfy.model_management.unload_all_models()
    comfy.model_management.soft_empty_cache()
    return rows


def _timed_row(wid: str, v: str, runs: list, first_s: float) -> Row:
    """The timing part of a row from the warm rounds' results (ComfyUI runs or peer runs)."""
    meds = [statistics.median(x.step_ms) for x in runs]
    walls = [x.wall_s for x in runs]
    psnrs = [x.extra["psnr"] for x in runs if x.extra.get("psnr") is not None]
    row = Row(
        workload=wid,
        variant=v,
        ms_step_median=statistics.median(meds),
        ms_step_mean=statistics.median([statistics.fmean(x.step_ms) for x in runs]),
        ms_step_min=min(meds),
        ms_step_max=max(meds),
        run_medians_ms=[round(m, 3) for m in meds],
        wall_s_median=statistics.median(walls),
        first_run_s=first_s,
        first_run_overhead_s=first_s - statistics.median(walls),
        psnr_vs_stock_db=min(psnrs) if psnrs else None,
    )
    # the warm runs' own spread: a first run within it had no overhead we can measure
    row.extra["warm_wall_spread_s"] = max(walls) - min(walls)
    return row


def peer_variant(mode: str) -> str:
    """The table's name of the diffusers peer with torch.compile ``mode`` ("eager": none)."""
    return f"diffusers ({mode})"


def _start_peers(wl, modes, models_dir, cuda: bool, first: dict, prog) -> tuple[dict, object]:
    """Build the diffusers peer for each compile mode and give it its first (compiling) run;
    a peer that cannot run on this workload is listed as not run, with the reason. Returns
    {variant name: peer} and the sigmas stock ComfyUI samples with."""
    if not modes:
        return {}, None
    from . import peers

    sigmas = peers.comfy_sigmas(wl)
    built: dict = {}
    for mode in modes:
        name = peer_variant(mode)
        peer = None
        try:
            peer = peers.build_peer(
                wl,
                models_dir,
                device="cuda" if cuda else "cpu",
                compile_mode=None if mode == "eager" else mode,
                progress=prog.note,
            )
            first[name] = peer.run(1001, sigmas).wall_s
        except Exception as e:  # a peer that cannot run this workload: say so, run the rest
            if peer is not None:
                peer.close()
            prog.not_run.append({"workload": wl.id, "variant": name, "why": str(e)[:600]})
            prog.note(f"{wl.id} {name} not run: {str(e)[:300]}")
            continue
        built[name] = peer
        prog.step(f"{wl.id} {name} first run {first[name]:.2f}s (compile included)")
    return built, sigmas


def _peer_busy(peer, wl, sigmas) -> tuple[float, float]:
    """GPU-busy ms and kernel launches per step of a peer: a whole run and one of half the
    steps under the profiler, the difference per step (as the ComfyUI variants are measured,
    so text encoding and the run's set-up cancel out)."""
    import torch
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as tprofile

    from . import peers, runner

    steps = wl.steps
    half = max(1, steps // 2)
    out = []
    for sig in (sigmas, peers.comfy_sigmas(wl.with_(steps=half))):
        with tprofile(activities=[ProfilerActivity.CUDA]) as prof:
            peer.run(3000, sig)
            torch.cuda.synchronize()
        out.append(runner._kernel_summary(prof))
    (busy_a, k_a), (busy_b, k_b) = out
    n = steps - half
    return (busy_a - busy_b) / n, (k_a - k_b) / n


def _not_run(wid: str, v: str, why: str, variants: list[str], prog) -> None:
    if v == "stock":
        raise RuntimeError(f"{wid}: stock ComfyUI did not run: {why}")
    variants.remove(v)
    prog.not_run.append({"workload": wid, "variant": v, "why": why[:600]})
    prog.note(f"{wid} {v} not run: {why[:300]}")


def _cold_reset() -> None:
    """Unload every model (their CUDA graphs go with them), drop the Feature Cache's kept
    buffers, and return cached memory to the driver."""
    import gc

    import comfy.model_management as mm
    import torch

    mm.unload_all_models()
    for name, mod in list(sys.modules.items()):
        if name.endswith("nodes.feature_cache") and hasattr(mod, "_POOLS"):
            for pools in list(mod._POOLS.values()):
                for pool in pools.values():
                    pool.clear()
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()


def unknown_inputs(prompt: dict) -> list[str]:
    """Inputs the prompt gives a node whose class does not declare them (a variant written for
    a newer version of a node than the one loaded), as "<class>: no input '<name>'"."""
    import nodes

    out = []
    for node in prompt.values():
        cls = nodes.NODE_CLASS_MAPPINGS.get(node["class_type"])
        if cls is None:
            continue  # ComfyUI's own validation names a missing node
        try:
            declared = cls.INPUT_TYPES()
        except Exception as e:  # a node that cannot list its inputs: let the run say why
            out.append(f"{node['class_type']}: its inputs could not be read ({e})")
            continue
        names = {n for part in ("required", "optional") for n in declared.get(part, {})}
        out += [
            f"{node['class_type']} has no input {name!r} in this version"
            for name in node["inputs"]
            if name not in names
        ]
    return out


def _graph_node_passed_model_on(runner, prompt: dict, ids: dict) -> bool:
    """Whether the prompt's CUDA Graph (model) node output is the very model it was given, as
    when it hands a model on unchanged (DynamicVRAM). Read from ComfyUI's cache of outputs, so it
    also answers for a node whose output was reused instead of run."""
    from .runner import WorkflowFailed

    nid = ids.get("CNA_CUDAGraph")
    if nid is None:
        return False
    src = prompt[nid]["inputs"].get("model")
    if not (isinstance(src, list) and len(src) == 2):
        return False
    try:
        out = runner.output_of(nid)[0]
        given = runner.output_of(str(src[0]))[int(src[1])]
    except (WorkflowFailed, IndexError):
        return False
    return out is given


def uses_graphs(variant: str) -> bool:
    """Whether the variant's prompt has a CUDA Graph node (the model patch or the KSampler)."""
    from .workflows import WORKLOADS, build_prompt

    p, _ = build_prompt(WORKLOADS["T1"], 0, ["hint.png"], VARIANTS[variant])
    return any(n["class_type"] in ("CNA_CUDAGraph", "CNA_KSamplerCUDAGraph") for n in p.values())


# Expected eager steps (a run's first step, a cache's first fill), not why a variant ran eager.
_EXPECTED_EAGER = ("first step of a run", "ControlNet Feature Cache: first compute")


def eager_note(reasons: list[str], width: int = 72) -> str:
    """A short "why this graph variant replayed no graph" from the graph cache's eager
    reasons."""
    real = [r for r in reasons if not r.startswith(_EXPECTED_EAGER)]
    if not real:
        return "no graph was replayed"
    first = real[0] if len(real[0]) <= width else real[0][: width - 1] + "…"
    return first + (f" (+{len(real) - 1} more)" if len(real) > 1 else "")


def overhead_text(r: Row) -> str:
    """First-run overhead for the table: "≈ 0" when the first run was no slower than the warm
    runs' own spread (it can even be faster, by noise)."""
    spread = r.extra.get("warm_wall_spread_s", 0.0)
    if r.first_run_overhead_s <= max(spread, 0.005):
        return "≈ 0"
    return f"{r.first_run_overhead_s:.2f}"


def _f(x, fmt="{:.2f}"):
    return "—" if x is None else ("∞" if x == float("inf") else fmt.format(x))


def cold_table(rows: list[Row], wl_info: dict) -> str:
    """Peak VRAM of one run per variant from a cold start (``--cold-memory``), vs stock's."""
    cold = [r for r in rows if "cold_peak_allocated_mib" in r.extra]
    if not cold:
        return ""
    stock = {r.workload: r for r in cold if r.variant == "stock"}
    lines = [
        "",
        "",
        "Cold start (nothing loaded or cached before the run; no decode):",
        "",
        "| workload | variant | prompt peak allocated MiB | vs stock | prompt peak reserved MiB "
        "| vs stock | sampling peak allocated MiB | vs stock | sampling peak reserved MiB "
        "| vs stock | sampling peak device MiB | vs stock |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    keys = [
        "cold_peak_allocated_mib",
        "cold_peak_reserved_mib",
        "cold_sampling_peak_allocated_mib",
        "cold_sampling_peak_reserved_mib",
        "cold_sampling_peak_device_mib",
    ]
    for r in cold:
        s = stock.get(r.workload)
        cells = []
        for k in keys:
            x = r.extra.get(k)
            ref = s.extra.get(k) if s else None
            cells.append("–" if x is None else f"{x:.0f}")
            cells.append(f"{100 * x / ref:.1f}%" if x is not None and ref else "–")
        lines.append(
            f"| {r.workload} ({wl_info[r.workload]}) | {r.variant} | " + " | ".join(cells) + " |"
        )
    return "\n".join(lines)


def table(rows: list[Row], wl_info: dict) -> str:
    head = (
        "| workload | variant | ms/step median (min–max) | ms/step mean | GPU-busy ms/step "
        "| launches/step | host ms/step | host ms/replay | launch wait ms/step "
        "| peak alloc MiB (resident) | peak reserved MiB | first-run overhead s "
        "| PSNR vs stock dB | image PSNR / SSIM vs stock | ControlNet calls run/reused |"
    )
    lines = [head, "|" + "---|" * 15]
    for r in rows:
        img = (
            f"{r.extra['image_psnr_vs_stock_db']:.1f} / {r.extra['ssim_vs_stock']:.4f}"
            if "ssim_vs_stock" in r.extra
            else "–"
        )
        calls = r.extra.get("controlnet_calls")
        calls_s = f"{calls['computed']}/{calls['reused']}" if calls else "–"
        name = r.variant
        if r.extra.get("passed_through"):
            name += f" (model passed through: {r.extra['passed_through']})"
        elif r.extra.get("ran_eager"):
            name += f" (ran eager: {r.extra['ran_eager']})"
        lines.append(
            f"| {r.workload} ({wl_info[r.workload]}) | {name} | {r.ms_step_median:.2f} "
            f"({r.ms_step_min:.2f}–{r.ms_step_max:.2f}) | {r.ms_step_mean:.2f} | "
            f"{_f(r.gpu_busy_ms_step)} | "
            f"{_f(r.launches_step, '{:.0f}')} | {_f(r.host_ms_step, '{:.3f}')} | "
            f"{_f(r.host_ms_replay, '{:.3f}')} | {_f(r.launch_ms_step, '{:.2f}')} | "
            f"{_f(r.peak_allocated_mib, '{:.0f}')} "
            f"({_f(r.resident_mib, '{:.0f}')}) | {_f(r.peak_reserved_mib, '{:.0f}')} | "
            f"{overhead_text(r)} | {_f(r.psnr_vs_stock_db, '{:.1f}')} | {img} | "
            f"{calls_s} |"
        )
    return "\n".join(lines)


# The other modes of benchmark.py: each replaces the quick benchmark and has its own options.
MODES = {
    "--kernels": "run the kernel microbenchmark instead (GPU only; harness/kernel_bench.py)",
    "--soak": "run the soak test: queued prompts through real ComfyUI servers (harness/soak.py)",
    "--mem-breakdown": "show where the peak VRAM of one run goes (GPU only; "
    "harness/mem_breakdown.py)",
}


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="benchmark.py",
        description=__doc__.split("\n")[0]
        + " With no mode option it runs the quick benchmark; a mode option runs that mode "
        "instead, with the mode's own options (listed below).",
    )
    modes = ap.add_argument_group("modes (one at most; each has the options listed below)")
    for flag, text in MODES.items():
        modes.add_argument(flag, action="store_true", help=text)
    quick = ap.add_argument_group("quick benchmark options")
    _quick_arguments(quick)
    return ap


def _quick_arguments(ap) -> None:
    ap.add_argument(
        "--workloads",
        help="comma list (default: W0..W5 on a GPU, T2 on a CPU; T0, T1, T2 are the CPU sizes)",
    )
    ap.add_argument(
        "--variants",
        default=",".join(DEFAULT_VARIANTS),
        help=f"comma list (default {','.join(DEFAULT_VARIANTS)}) of: " + ", ".join(VARIANTS),
    )
    ap.add_argument(
        "--rounds",
        type=int,
        help=f"interleaved warm rounds (default {GPU_ROUNDS} on a GPU, {CPU_ROUNDS} on a CPU)",
    )
    ap.add_argument("--steps", type=int, help="override the workloads' step count")
    ap.add_argument(
        "--op-profile",
        action="store_true",
        help="also profile GPU time per op kind (conv, attention, GroupNorm, ...)",
    )
    ap.add_argument("--no-profile", action="store_true", help="skip the torch.profiler runs")
    ap.add_argument(
        "--cold-memory",
        action="store_true",
        help="also measure each variant's peak VRAM in one run from a cold start (GPU only)",
    )
    ap.add_argument(
        "--decode",
        action="store_true",
        help="decode the images with the VAE and report PSNR and SSIM vs stock per variant",
    )
    ap.add_argument("--cpu", action="store_true", help="run on the CPU even if a GPU is present")
    ap.add_argument(
        "--models-dir",
        type=Path,
        help="where generated models live "
        "(default $CNA_MODELS_DIR or ~/.cache/comfyui-controlnet-accelerator/models)",
    )
    ap.add_argument(
        "--out", type=Path, default=Path("bench-results"), help="folder for JSON + table"
    )
    ap.add_argument(
        "--peers",
        action="store_true",
        help="also run diffusers' ControlNet pipeline on the same weights, prompts, noise and "
        "sigmas, with torch.compile (needs diffusers: pip install --no-deps diffusers==0.42.1; "
        "SD1.5 and SDXL workloads with ControlNets)",
    )
    ap.add_argument(
        "--peer-modes",
        default=",".join(PEER_MODES),
        help=f"the peers' torch.compile modes (default {','.join(PEER_MODES)}; 'eager' for none)",
    )
    ap.add_argument(
        "--compile-phases",
        action="store_true",
        help="also report where each first run's compiles spent their time, by phase "
        "(torch's own timers: tracing, guards, lowering, kernel generation, cache reads, ...)",
    )
    ap.add_argument(
        "--native-allocator",
        action="store_true",
        help="keep PyTorch's native allocator instead of ComfyUI's cudaMallocAsync default",
    )
    ap.add_argument(
        "--free-vram",
        type=float,
        metavar="GIB",
        help="leave only this many GiB of the GPU free for the run, as on a smaller card (a "
        "helper process holds the rest; the card's total still reads as its own)",
    )


def show_pack_log() -> None:
    """The pack's own log lines at INFO (compiles and their times, fallbacks and their reasons)
    beside the benchmark's progress: ComfyUI's logging setup does not run in this process, so
    without a handler only warnings would reach the terminal, through Python's last resort."""
    import logging

    from ..logger import logger as pack_logger

    pack_logger.setLevel(logging.INFO)
    if not logging.getLogger().handlers and not pack_logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("  [pack] %(levelname)s %(message)s"))
        pack_logger.addHandler(handler)


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    a = ap.parse_args(argv)
    chosen = [f for f in MODES if getattr(a, f.lstrip("-").replace("-", "_"))]
    if chosen:  # benchmark.py dispatches the modes before this parser sees them
        ap.error(f"{chosen[0]} runs its own mode: python benchmark.py {chosen[0]} [options]")

    from . import comfy_host  # torch-free: the allocator is chosen before torch is imported

    held = contextlib.ExitStack()  # the --free-vram helper, started before ComfyUI looks
    hold = None
    if a.free_vram is not None:
        if a.cpu:
            ap.error("--free-vram needs a GPU")
        from .vram_hold import Hold

        try:
            hold = held.enter_context(Hold(a.free_vram))
        except (ValueError, RuntimeError) as e:
            ap.error(str(e))
    models_dir = a.models_dir or comfy_host.default_models_dir()
    host = comfy_host.bootstrap(
        cpu=True if a.cpu else None, models_dir=models_dir, cuda_malloc=not a.native_allocator
    )
    import comfy.utils

    comfy.utils.set_progress_bar_enabled(False)
    show_pack_log()
    from .workflows import WORKLOADS

    wids = a.workloads.split(",") if a.workloads else (CPU_WORKLOADS if host.cpu else GPU_WORKLOADS)
    variants = a.variants.split(",")
    unknown = [v for v in variants if v not in VARIANTS] + [w for w in wids if w not in WORKLOADS]
    if unknown:
        ap.error(f"unknown workload/variant: {unknown}")
    if "stock" not in variants:
        variants.insert(0, "stock")
    peer_modes: tuple[str, ...] = ()
    if a.peers:
        from . import peers

        peer_modes = tuple(a.peer_modes.split(","))
        try:
            for m in peer_modes:
                if m != "eager":
                    peers.check_compile_mode(m)
            peers.require_diffusers()
        except (ValueError, ImportError) as e:
            ap.error(f"--peers: {e}")
    if a.rounds is None:
        a.rounds = CPU_ROUNDS if host.cpu else GPU_ROUNDS
    profile = not a.no_profile and not host.cpu
    op_profile = a.op_profile and not host.cpu
    cold_memory = a.cold_memory and not host.cpu
    extra_runs = int(profile) + int(op_profile) + int(cold_memory)
    per_wl = 1 + len(variants) * (1 + a.rounds + extra_runs)
    per_wl += len(peer_modes) * (1 + a.rounds + int(profile))
    prog = Progress(per_wl * len(wids))
    env = environment()
    if hold is not None:
        import torch

        env["free_vram"] = {
            "asked_gib": a.free_vram,
            "free_mib": torch.cuda.mem_get_info()[0] // 2**20,
            "held_mib": hold.held_mib,
        }
    prog.note(
        f"ComfyUI {env.get('comfyui')} at {host.root}; torch {env['torch']}; "
        f"{env.get('gpu', 'CPU')}; allocator {env['allocator']}"
    )
    rows: list[Row] = []
    wl_info = {w: _describe(WORKLOADS[w], a.steps) for w in wids}
    ran = what_ran(
        host.cpu,
        wl_info,
        variants + [peer_variant(m) for m in peer_modes],
        a.rounds,
        defaults=not a.workloads,
    )
    if hold is not None:
        ran += (
            f" Free GPU memory held to {env['free_vram']['free_mib']} MiB at the start "
            f"({hold.held_mib} MiB held by a helper process, counted in the driver's used memory)."
        )
    prog.note(ran)
    out = a.out
    out.mkdir(parents=True, exist_ok=True)
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    for wid in wids:
        rows.extend(
            run_workload(
                wid,
                variants,
                a.rounds,
                profile,
                a.steps,
                models_dir,
                prog,
                op_profile=op_profile,
                decode=a.decode,
                cold_memory=cold_memory,
                peers=peer_modes,
                compile_phases=a.compile_phases,
            )
        )
        partial = {
            "environment": env,
            "workloads": wl_info,
            "rounds": a.rounds,
            "partial": True,
            "rows": [asdict(r) for r in rows],
            "not_run": prog.not_run,
        }
        (out / f"quick-{stamp}.json").write_text(json.dumps(partial, indent=1))
    prog.close()
    held.close()
    text = ran + "\n\n" + table(rows, wl_info) + cold_table(rows, wl_info)
    if a.compile_phases:
        text += phases_text(rows)
    if prog.not_run:
        text += "\n\nNot run:\n" + "\n".join(
            f"- {n['workload']} {n['variant']}: {n['why'][:300]}" for n in prog.not_run
        )
    payload = {
        "environment": env,
        "ran": ran,
        "workloads": wl_info,
        "rounds": a.rounds,
        "rows": [asdict(r) for r in rows],
        "not_run": prog.not_run,
    }
    (out / f"quick-{stamp}.json").write_text(json.dumps(payload, indent=1))
    (out / f"quick-{stamp}.md").write_text(f"Environment: {json.dumps(env)}\n\n{text}\n")
    print(f"\n{text}\n\nwritten: {out / f'quick-{stamp}.json'} and .md")
    bad = [f"{r.workload}/{r.variant}" for r in rows if not r.extra["finite"]]
    if bad:
        print(f"non-finite latents in {bad}", file=sys.stderr)
        return 1
    return 0


def phases_text(rows: list[Row]) -> str:
    """``--compile-phases``: per workload, the first runs' compile time by phase."""
    from . import compile_phases as cp

    out = ""
    for wid in dict.fromkeys(r.workload for r in rows):
        got = {
            r.variant: r.extra["compile_phases"]
            for r in rows
            if r.workload == wid and "compile_phases" in r.extra
        }
        body = cp.text(got)
        out += f"\n\n{wid}: " + (body or "no compile in any first run")
    return out


def what_ran(cpu: bool, wl_info: dict, variants: list[str], rounds: int, defaults: bool) -> str:
    """One line for the top of the output: where it ran, which workloads, variants and rounds."""
    wls = "; ".join(f"{w} ({d})" for w, d in wl_info.items())
    line = (
        f"Ran on {'the CPU' if cpu else 'the GPU'}: {wls}; variants {', '.join(variants)}; "
        f"1 first run + {rounds} warm round(s) each."
    )
    if cpu:
        line += " A functional check on tiny models, not a speed measurement"
        if defaults:
            line += " (CPU defaults; --workloads T0,T1,T2 --rounds 3 runs more)"
        line += "."
    return line


def _describe(wl, steps) -> str:
    from .random_models import SPECS

    arch = SPECS[wl.checkpoint].arch
    return f"{arch} {wl.width}², {len(wl.controlnets)} CN, {steps or wl.steps} steps"
