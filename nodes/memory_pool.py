# SPDX-License-Identifier: GPL-3.0-or-later
"""ControlNet Memory Pool: ComfyUI glue for the memory levers (``memory/weight_compress.py``,
``memory/prefetch.py``).

What it does to a workflow's models, through ComfyUI's own extension points only:

- **Compressed or streamed weights.** A clone of the MODEL's (and of the ControlNet's)
  ModelPatcher with one *object patch* per large Linear/Conv2d: while the clone is loaded the
  layer is an INT8 module (``Int8Conv2d``/``Int8Linear``: int8 weight in VRAM, expanded per
  call) or a streamed one (``StreamedConv2d``/``StreamedLinear``: the weight as loaded in pinned
  system RAM, copied in one layer ahead), and the fp16 original is out of the model tree, so
  ComfyUI's loader moves only what stays in VRAM. Unpatching (another clone taking over,
  unload) puts the originals back: stock nodes sharing the checkpoint never see them. The clone
  reports its real, smaller size to ComfyUI's memory manager (``ModelPatcher.size``) and gets a
  new ``patches_uuid``, so when it is loaded over a clone whose fp16 weights sit on the GPU,
  ComfyUI unpatches those first (they go back to the offload device) instead of keeping both.
  A model ComfyUI had already loaded on the GPU is unloaded before it is compressed.
- **Working memory told to ComfyUI.** A PREPARE_SAMPLING wrapper adds the pool's own working
  memory (``MemoryPoolPatch.reserve_bytes``) to the estimate ComfyUI frees memory for before it
  loads the run's models. ComfyUI has no public way to add to that estimate, so for that one
  call the model's ``memory_required`` is wrapped on the instance and restored after it; it is
  the pack's one remaining edit of a ComfyUI object. Under DynamicVRAM (ComfyUI 0.33 on NVIDIA
  GPUs) nothing is added: working memory is then found on demand, by evicting weights.
- **Idle models out of the way.** Optionally, before sampling, unload from the GPU every model
  this sampling run does not use (typically the text encoder and the VAE, which ComfyUI keeps
  resident), through ComfyUI's ``free_memory`` with the run's models kept; ComfyUI loads them
  again when a later node needs them.
- **DynamicVRAM** (``nodes/compat.py``). The replaced layers are plain modules to ComfyUI, so
  DynamicVRAM loads their int8 weights whole at every load (streamed layers keep theirs in
  pinned RAM) and manages every other layer as usual; the log says so once. It never loads a
  checkpoint whole to the GPU, reserves nothing for the pool (``working_memory_to_reserve``),
  and the network's shared virtual VRAM range is made at the full network's size before a
  smaller pooled clone could make it (``compat.size_dynamic_range``).
- **Report.** Peak allocated and reserved VRAM of each sampling run, logged and shown on the
  node's badge with the run's prefetch figures (``prefetch.counting``).
"""

from __future__ import annotations

import dataclasses
import threading
import time
import uuid
import weakref

import torch

from ..errors import NodeInputError, is_out_of_memory
from ..logger import logger
from ..memory import prefetch
from ..memory import weight_compress as wc
from . import compat, status
from .fused_apply import context_width, family

WRAPPER_KEY = "cna_memory_pool"
NODE = "ControlNet Memory Pool"
MiB = 1024 * 1024

_lock = threading.Lock()
# original module -> (weight key, compressed module); dropped with the module
_COMPRESSED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


@dataclasses.dataclass(frozen=True)
class PoolOptions:
    unet_weights: str = "int8"  # "int8" | "as loaded" | "stream"
    controlnet_weights: str = "int8"
    offload_idle_models: bool = False


WEIGHT_MODES = ("int8", "as loaded", "stream")


def _weight_key(w: torch.Tensor) -> tuple:
    """Cheap identity of a weight's values: shape, dtype and a strided sample's sum."""
    flat = w.detach().reshape(-1)
    step = max(1, flat.numel() // 61)
    return (tuple(w.shape), w.dtype, float(flat[::step].float().sum()))


def _original(patcher, key: str, current: torch.Tensor | None) -> torch.Tensor | None:
    """The unpatched value of ``key``: while a LoRA'd clone is loaded, ComfyUI's ``backup``
    holds the original and the module holds the patched weight."""
    bk = getattr(patcher, "backup", {}).get(key)
    return bk.weight if bk is not None else current


def _compressed_module(patcher, name: str, module, made: list, mode: str) -> torch.nn.Module:
    w = _original(patcher, f"{name}.weight", module.weight)
    b = _original(patcher, f"{name}.bias", module.bias)
    key = (mode, _weight_key(w))
    with _lock:
        hit = _COMPRESSED.get(module)
    if hit is not None and hit[0] == key:
        return hit[1]
    if mode == "stream":  # a copy in pinned RAM: nothing to compute on the GPU
        c = wc.compress(module, w, b, mode=mode)
    else:
        try:
            c = wc.compress(module, _on_compute_device(patcher, w), b, mode=mode)
        except Exception as e:  # no room on the GPU for one layer: the CPU does it, slower
            if not is_out_of_memory(e):
                raise
            c = wc.compress(module, w, b, mode=mode)
    c = c.to(patcher.offload_device)
    with _lock:
        _COMPRESSED[module] = (key, c)
    made.append(module)
    return c


def _on_compute_device(patcher, w: torch.Tensor) -> torch.Tensor:
    """``w`` on the model's GPU, where quantizing it takes milliseconds: an unloaded
    ControlNet's weights sit on the CPU, where the same fp32 arithmetic took 8-12 s per SD1.5
    ControlNet (the H200 soak). One layer at a time, so the GPU holds one layer's
    fp32 copy at most (if even that does not fit, the caller quantizes on the CPU); the int8
    result goes back to the offload device like the original."""
    dev = getattr(patcher, "load_device", None)
    if isinstance(dev, torch.device) and dev.type == "cuda" and w.device != dev:
        return w.detach().to(dev, non_blocking=False)
    return w


@dataclasses.dataclass
class CompressReport:
    what: str = ""
    mode: str = "int8"
    failed: str | None = None  # why the weights stayed as loaded (out of memory)
    layers: int = 0
    skipped_patched: int = 0
    kept_small: int = 0  # INT8: small layers left as loaded (wc.small_layers_kept)
    launches: int = 0  # INT8: expansion launches per model call (one per ExpansionGroup)
    bytes_before: int = 0
    bytes_after: int = 0
    seconds: float = 0.0

    def line(self, what: str) -> str:
        where = "in VRAM " if self.mode == "stream" else ""
        return (
            f"{what}: {self.layers} layers {self.mode}, weights {where}"
            f"{self.bytes_before / MiB:.0f} → {self.bytes_after / MiB:.0f} MiB"
            + (
                f" ({(self.bytes_before - self.bytes_after) / MiB:.0f} MiB streamed from "
                "pinned RAM each step)"
                if self.mode == "stream"
                else ""
            )
            + (f", {self.skipped_patched} LoRA-patched layers kept" if self.skipped_patched else "")
            + (f", {self.kept_small} small layers kept as loaded" if self.kept_small else "")
            + (
                f", expanded by {self.launches} launches a call"
                if 0 < self.launches < self.layers
                else ""
            )
            + f" ({self.seconds:.1f} s)"
        )


def _patched_keys(patcher) -> set[str]:
    return set(getattr(patcher, "patches", {}) or {})


def _layers(patcher, root, prefix: str) -> list[tuple[str, torch.nn.Module]]:
    """The compressible layers of the *unpatched* model: while a clone with object patches is
    loaded, the live tree holds its replacements and ``object_patches_backup`` (shared by all
    clones) the originals."""
    backup = getattr(patcher, "object_patches_backup", {}) or {}
    out = []
    for name, module in root.named_modules():
        if not name:
            continue
        module = backup.get(prefix + name, module)
        if wc.why_not(module) is None:
            out.append((name, module))
    return out


def compress_patcher(patcher, root_attr: str | None, what: str, mode: str = "int8"):
    """A clone of ``patcher`` whose large layers under ``patcher.model.<root_attr>`` (the whole
    model when None) are int8 (``mode`` "int8") or streamed from pinned RAM ("stream") while it
    is loaded. Returns (clone, report)."""
    t0 = time.perf_counter()
    root = patcher.model if root_attr is None else getattr(patcher.model, root_attr)
    prefix = "" if root_attr is None else f"{root_attr}."
    patched = _patched_keys(patcher)
    rep = CompressReport(what=what, mode=mode)
    clone = patcher.clone()
    made: list = []  # modules compressed by this call: forgotten again if it fails
    layers = _layers(patcher, root, prefix)
    small = wc.small_layers_kept({n: m.weight.numel() for n, m in layers}) if mode == "int8" else ()
    try:
        for name, module in layers:
            full = prefix + name
            if isinstance(patcher.object_patches.get(full), wc._Replaced):
                continue  # compressed by an earlier Memory Pool node (counted in its size)
            if name in small:
                rep.kept_small += 1
                continue
            if f"{full}.weight" in patched or f"{full}.bias" in patched:
                rep.skipped_patched += 1
                continue
            c = _compressed_module(patcher, full, module, made, mode)
            clone.add_object_patch(full, c)
            rep.layers += 1
            rep.bytes_before += c.original_bytes()
            rep.bytes_after += c.compressed_bytes()
    except BaseException:
        with _lock:
            for module in made:
                _COMPRESSED.pop(module, None)
        raise
    if rep.layers and mode == "int8":
        rep.launches = _group_int8_layers(clone)
    if rep.layers:
        compat.size_dynamic_range(patcher)  # before a smaller clone could size it
        clone.size = max(1, patcher.model_size() - rep.bytes_before + rep.bytes_after)
        clone.patches_uuid = uuid.uuid4()
    else:
        rep.kept_small = 0  # an earlier Memory Pool node compressed this model and counted them
    rep.seconds = time.perf_counter() - t0
    logger.info("Memory Pool: %s", rep.line(what))
    return clone, rep


def _group_int8_layers(patcher) -> int:
    """One expansion launch per block for ``patcher``'s INT8 layers (``wc.ExpansionGroup``):
    those it samples with, earlier Memory Pool nodes' included. Returns the launches a model
    call makes for them."""
    int8 = [(k, v) for k, v in patcher.object_patches.items() if isinstance(v, wc._Int8Weight)]
    wc.form_expansion_groups(int8, getattr(patcher, "load_device", None))
    return len({id(v.expansion_group or v) for _, v in int8})


def _without_lora_patched_layers(patcher):
    """``patcher``, or a clone of it without our object patches on layers that a later node (a
    LoRA) patches, so the LoRA applies to the fp16 weight. A clone: ``patcher`` is another
    node's cached output (the LoRA loader's) and must not change."""
    patched = _patched_keys(patcher) if patcher is not None else set()
    if not any(
        isinstance(v, wc._Replaced) and (f"{k}.weight" in patched or f"{k}.bias" in patched)
        for k, v in (getattr(patcher, "object_patches", None) or {}).items()
    ):
        return patcher
    clone = patcher.clone()
    n = _drop_patched_layers(clone)
    _group_int8_layers(clone)  # the dropped layers out of their blocks' groups
    logger.info("Memory Pool: %d layers patched by a LoRA after this node stay fp16", n)
    return clone


def _drop_patched_layers(patcher) -> int:
    """At sampling time: object patches of ours on layers that some later node (a LoRA) patches
    are dropped from this run's patcher, so the LoRA applies to the fp16 weight."""
    patched = _patched_keys(patcher)
    if not patched:
        return 0
    drop = [
        k
        for k, v in patcher.object_patches.items()
        if isinstance(v, wc._Replaced) and (f"{k}.weight" in patched or f"{k}.bias" in patched)
    ]
    for k in drop:
        c = patcher.object_patches.pop(k)
        patcher.size = patcher.size - c.compressed_bytes() + c.original_bytes()
    return len(drop)


class MemoryPoolPatch:
    def __init__(
        self, options: PoolOptions, node_id=None, reports: list | None = None, earlier=None
    ):
        self.options = options
        self.node_id = node_id  # the node whose badge gets the run's figures
        self.reports = reports if reports is not None else []  # CompressReports of its weights
        # Memory Pool nodes chained before this one on the same model (one per ControlNet):
        # one wrapper serves them all, each badge gets the run's figures and its own weights
        self.earlier: list[tuple] = list(getattr(earlier, "nodes", []))
        self.offload = options.offload_idle_models or bool(getattr(earlier, "offload", False))
        self._offloaded: list[str] = []
        self._prefetch: dict = {}
        self._graph_idle = 0  # the CUDA graph pool's idle bytes at the end of the last run
        self.reserved = 0  # what the last run asked ComfyUI to keep free for the pool
        # (patcher, its patches_uuid, the clone sampled in its place): one entry, so a prompt
        # repeated over a later LoRA samples the same clone, which ComfyUI keeps loaded
        self._run_clone: tuple | None = None

    @property
    def nodes(self) -> list[tuple]:
        """(node id, its CompressReports) of this node and the ones chained before it."""
        return [*self.earlier, (self.node_id, self.reports)]

    def reserve_bytes(self, patchers=()) -> int:
        """Working memory the pool needs beyond ComfyUI's own estimate of the step: the weights
        of the INT8 block running, expanded to fp16 at once (``wc.ExpansionGroup``), and for
        streamed layers the one running plus the one being copied in ahead (the largest of each
        kind among ``patchers``' replaced layers); and the idle part of the CUDA graph pool,
        which ComfyUI's free-memory figure counts as free under PyTorch's native allocator though
        only graph replays can use it (measured at the end of the previous run: the pool is
        sized by the first)."""
        largest = {"int8": 0, "stream": 0}
        for p in patchers:
            for obj in (getattr(p, "object_patches", None) or {}).values():
                if isinstance(obj, wc._Int8Weight):
                    largest["int8"] = max(largest["int8"], obj.working_bytes())
                elif isinstance(obj, wc._Replaced):
                    largest["stream"] = max(largest["stream"], obj.original_bytes())
        return largest["int8"] + 2 * largest["stream"] + self._graph_idle

    def prepare_sampling_wrapper(self, executor, *args, **kwargs):
        """ComfyUI sizes what it frees before loading the run's models from the model's
        ``memory_required``; for this call it also counts the pool (``reserve_bytes``).
        Whatever arguments this ComfyUI passes go through unchanged."""
        a = compat.prepare_sampling_args(args, kwargs)
        model, conds = a.get("model"), a.get("conds") or {}
        self.reserved = 0
        dynamic = compat.is_dynamic(model)
        if dynamic:
            compat.info_once(
                "pool:dynamic",
                "Memory Pool: ComfyUI's DynamicVRAM is on: the pool's INT8 layers are loaded "
                "whole and streamed ones stay in pinned RAM, while the other layers and the "
                "working memory are left to DynamicVRAM, which loads weights as they run (no "
                "working memory is reserved for the pool). This saves VRAM, but each step is "
                "slower than without the pool (1.5-1.9x at SDXL 1024² on an H200): the CUDA "
                "Graph nodes are off and the INT8 weights are expanded eagerly. Start ComfyUI "
                "with --disable-dynamic-vram for the pool at the graph stack's speed",
            )
            needed = 0  # not counted: nothing would be done with it
        else:
            try:
                patchers = _models_of(model, conds)
            except Exception as e:  # a newer ComfyUI's conds: count the model's layers only
                logger.debug("Memory Pool: models of the run unknown (%s)", e)
                patchers = [model]
            needed = self.reserve_bytes(patchers)
        reserve = working_memory_to_reserve(dynamic, needed)
        base = getattr(model, "model", None)
        orig = getattr(base, "memory_required", None)
        if reserve <= 0 or not callable(orig):
            return executor(*args, **kwargs)
        had = "memory_required" in vars(base)

        def memory_required(*a, **kw):
            return orig(*a, **kw) + reserve

        base.memory_required = memory_required
        self.reserved = reserve
        try:
            return executor(*args, **kwargs)
        finally:
            if had:
                base.memory_required = orig
            else:
                del base.memory_required

    def calc_cond_batch_wrapper(self, executor, *args, **kwargs):
        """One step: the weights prepared ahead are joined when it ends (eager steps; a CUDA
        graph's step function joins them itself, inside its capture)."""
        try:
            return executor(*args, **kwargs)
        finally:
            prefetch.end_pass()

    def outer_sample_wrapper(self, executor, *args, **kwargs):
        guider = executor.class_obj
        patcher = getattr(guider, "model_patcher", None)
        run_patcher = self._run_patcher(patcher)
        if run_patcher is not patcher:
            # This run samples a clone, through a copy of the guider: the guider may be another
            # node's cached output (a CFGGuider node's) and stays as made.
            moved = compat.rest_of_chain_on_copy(executor, model_patcher=run_patcher)
            if moved is None:  # not on 0.3.64 or 0.33: a sampler that binds no guider method
                raise NodeInputError(
                    NODE,
                    "model",
                    "is patched by a LoRA after this node, on layers the pool stores in its own "
                    "form, and this ComfyUI's sampler cannot sample the pool's copy without them",
                    "Apply the LoRA before the ControlNet Memory Pool node",
                )
            guider, executor = moved
        return self._outer_sample(executor, guider, run_patcher, *args, **kwargs)

    def _run_patcher(self, patcher):
        """What this run samples: ``patcher``, or (a later LoRA patches layers we replaced) its
        clone without those replacements, the same clone for as long as ``patcher`` is."""
        held = self._run_clone
        if held is not None and held[0] is patcher and held[1] == patcher.patches_uuid:
            return held[2]
        run = _without_lora_patched_layers(patcher)
        self._run_clone = None if run is patcher else (patcher, patcher.patches_uuid, run)
        return run

    def _outer_sample(self, executor, guider, patcher, *args, **kwargs):
        try:
            _park_originals(guider)
        except Exception as e:  # never fail the run over memory placement
            logger.warning("Memory Pool: could not move replaced weights off the GPU (%s)", e)
        self._offloaded = []
        if self.offload:
            try:
                self._offloaded = _offload_idle(guider)
            except Exception as e:  # a newer ComfyUI's memory manager: never fail the run
                logger.warning("Memory Pool: could not offload idle models (%s)", e)
        dev = getattr(patcher, "load_device", None)
        cuda = isinstance(dev, torch.device) and dev.type == "cuda" and torch.cuda.is_available()
        if cuda:
            torch.cuda.reset_peak_memory_stats(dev)
        ok = False
        counts: dict = {}
        try:
            with prefetch.counting() as counts:  # this run's prefetch figures, for the badge
                try:
                    out = executor(*args, **kwargs)
                    ok = True
                finally:
                    prefetch.end_pass()
            return out
        finally:
            _release_run_expansions(guider, patcher)
            self._finish(counts, ok, cuda, dev)

    def _finish(self, counts: dict, ok: bool, cuda: bool, dev) -> None:
        """After a sampling run however it ended: the figures, the log line, the badge."""
        self._prefetch = dict(counts)
        if cuda:
            self._graph_idle = graph_pool_idle_bytes(dev)
            fig = {
                "peak_allocated_mib": torch.cuda.max_memory_allocated(dev) / MiB,
                "peak_reserved_mib": torch.cuda.max_memory_reserved(dev) / MiB,
                "completed": ok,
            }
            logger.info(
                "Memory Pool: sampling peak VRAM %.0f MiB allocated, %.0f MiB reserved",
                fig["peak_allocated_mib"],
                fig["peak_reserved_mib"],
            )
        if ok:
            self._report(fig if cuda else {"completed": ok})

    def _report(self, fig: dict) -> None:
        shared = []
        if "peak_allocated_mib" in fig:
            shared.append(
                f"peak VRAM {status.mib(fig['peak_allocated_mib'] * MiB)} "
                f"(reserved {status.mib(fig['peak_reserved_mib'] * MiB)})"
            )
        else:
            shared.append("peak VRAM: n/a (not on a CUDA GPU)")
        tail = []
        if self.reserved:
            tail.append(f"kept free for the pool: {status.mib(self.reserved)}")
        pf = self._prefetch
        if pf.get("prepared") or pf.get("direct"):
            tail.append(
                f"streamed layers copied ahead: {pf.get('used', 0)}, "
                f"where used: {pf.get('direct', 0)}"
            )
        if self._offloaded:
            tail.append("unloaded while sampling: " + ", ".join(self._offloaded))
        for node_id, reports in self.nodes:
            lines = list(shared)
            for mode in ("int8", "stream"):
                rs = [r for r in reports if r.mode == mode and r.layers]
                if rs:
                    b0 = sum(r.bytes_before for r in rs)
                    b1 = sum(r.bytes_after for r in rs)
                    name = "weights int8" if mode == "int8" else "weights in VRAM (streamed)"
                    lines.append(f"{name}: {status.mib(b0)} → {status.mib(b1)}")
            failed = {r.what: r.failed for r in reports if r.failed}
            for what, why in failed.items():
                lines.append(f"{what} as loaded: {status.short(why, 40)}")
            data = {
                **fig,
                "weights_before": sum(r.bytes_before for r in reports),
                "weights_after": sum(r.bytes_after for r in reports),
                "small_layers_kept": sum(r.kept_small for r in reports),
                "prefetch": dict(pf),
                "reserved": self.reserved,
                "graph_pool_idle": self._graph_idle,
                "offloaded": list(self._offloaded),
            }
            if failed:
                data["int8_failed"] = failed
            status.report(node_id, "memory_pool", lines + tail, data)


def working_memory_to_reserve(dynamic: bool, needed: int) -> int:
    """What the pool asks ComfyUI to keep free before it loads a run's models.

    With the legacy loader, ComfyUI frees (unloads whole models) only what the step's estimate
    says, so the pool's own working memory (``MemoryPoolPatch.reserve_bytes``) is added to it.
    Under DynamicVRAM nothing is: ComfyUI 0.33 then never unloads a dynamic model to make room
    for another (``free_memory(..., for_dynamic=True)`` frees 0 for them), and every later
    allocation that finds no room evicts unpinned weight pages on demand (comfy-aimdo hooks
    ``cuMemAlloc``), the pool's expansion buffers included."""
    return 0 if dynamic else max(0, int(needed))


def graph_pool_idle_bytes(device) -> int:
    """Bytes in CUDA graph private pools on ``device`` that no tensor uses. Under PyTorch's
    native allocator ComfyUI counts them as free (reserved minus active), yet only graph
    replays can use them. Under cudaMallocAsync graph memory is outside the pool PyTorch
    reports and already counts as used: 0. Never fails: 0 when it cannot tell."""
    try:
        if torch.cuda.get_allocator_backend() != "native":
            return 0
        idx = torch.device(device).index
        idx = torch.cuda.current_device() if idx is None else idx
        idle = 0
        for seg in torch.cuda.memory_snapshot():
            if seg.get("device") != idx or tuple(seg.get("segment_pool_id", (0, 0))) == (0, 0):
                continue
            idle += sum(b["size"] for b in seg.get("blocks", []) if b.get("state") == "inactive")
        return idle
    except Exception as e:  # a newer PyTorch's snapshot format: report nothing rather than fail
        logger.debug("Memory Pool: graph pool size unknown (%s)", e)
        return 0


def _models_of_run(guider) -> list:
    """The ModelPatchers this sampling run loads: the model, its ControlNets and extras."""
    return _models_of(guider.model_patcher, getattr(guider, "conds", None) or {})


def _models_of(patcher, conds) -> list:
    """``patcher`` and the ModelPatchers sampling it with ``conds`` loads beside it (the
    ControlNets' and other additional models, as ComfyUI's prepare_sampling collects them)."""
    import comfy.sampler_helpers as sh

    models = [patcher]
    extra, _ = sh.get_additional_models(conds, patcher.model_dtype())
    models += extra
    models += patcher.get_nested_additional_models()
    for m in list(models):
        models += list(m.model_patches_models())
    return models


def _release_run_expansions(guider, patcher) -> None:
    """The end of a run: every expansion group of the run's models (the sampled model's and
    the ControlNets') drops the views its layers did not take."""
    try:
        models = _models_of_run(guider)
    except Exception as e:  # a newer ComfyUI's conds: the sampled model's groups at least
        logger.debug("Memory Pool: models of the run unknown (%s)", e)
        models = [patcher]
    for p in models:
        wc.release_expansions((getattr(p, "object_patches", None) or {}).values())


def _park_originals(guider) -> None:
    """Move the fp16 layers our INT8 modules replace to the offload device before ComfyUI
    loads the run's models. They can sit on the GPU (ComfyUI loads a checkpoint straight to
    the GPU when it has more free VRAM than RAM, or a stock clone left them there); loading the
    INT8 copies beside them would hold both for a moment and set the peak."""
    moved = 0
    for p in _models_of_run(guider):
        backup = getattr(p, "object_patches_backup", {}) or {}
        for key, obj in getattr(p, "object_patches", {}).items():
            if not isinstance(obj, wc._Replaced):
                continue
            orig = backup.get(key)
            if orig is None:
                import comfy.utils

                orig = comfy.utils.get_attr(p.model, key)
            if isinstance(orig, wc._Replaced) or not isinstance(orig, torch.nn.Module):
                continue
            w = getattr(orig, "weight", None)
            if isinstance(w, torch.Tensor) and w.device != torch.device(p.offload_device):
                orig.to(p.offload_device)
                moved += 1
    if moved:
        import comfy.model_management as mm

        mm.soft_empty_cache()
        logger.info("Memory Pool: moved %d replaced fp16 layers off the GPU", moved)


def _unload_from_gpu(patcher) -> None:
    """Before its layers are replaced: unload ``patcher``'s model from the GPU the way ComfyUI
    does (its weights go back to the offload device, its bookkeeping follows). Where ComfyUI
    loaded a checkpoint straight to the GPU (more VRAM than RAM, as on the H200), the fp16
    weights would otherwise sit there until sampling loads the replacement, the fp16 and INT8
    copies side by side while compressing (measured: the prompt's peak). Compressing then
    brings one layer at a time to the GPU. The sampler loads the compressed copy as usual;
    a stock node using the checkpoint loads the original again, as ComfyUI always does."""
    dev = getattr(patcher, "load_device", None)
    if not isinstance(dev, torch.device) or dev.type != "cuda":
        return
    if compat.unload_models_of(patcher, dev):
        import comfy.model_management as mm

        mm.soft_empty_cache()
        logger.info("Memory Pool: unloaded the %s from the GPU to compress it", _what_of(patcher))


def _what_of(patcher) -> str:
    return type(getattr(patcher, "model", patcher)).__name__


def _offload_idle(guider) -> list[str]:
    """Unload from the sampling device every loaded model this run does not use (ComfyUI's
    ``free_memory``, the run's models kept)."""
    freed = [
        type(p.model).__name__
        for p in compat.unload_all_but(_models_of_run(guider), guider.model_patcher.load_device)
    ]
    if freed:
        logger.info("Memory Pool: unloaded idle models for sampling: %s", ", ".join(freed))
    return freed


def apply_memory_pool(model, control_net, options: PoolOptions, node_id=None):
    """What the node does: (model, control_net) patched as ``options`` say."""
    m = model
    reports: list[CompressReport] = []
    validate_inputs(model, control_net, options)
    if options.unet_weights != "as loaded":
        if getattr(model.model, "diffusion_model", None) is None:
            logger.warning("Memory Pool: this MODEL has no diffusion_model; weights as loaded")
            m = model.clone()
        else:
            _unload_from_gpu(model)
            got, rep = _compress_or_not(
                model, "diffusion_model", "diffusion model", options.unet_weights
            )
            m = got if got is not None else model.clone()
            reports.append(rep)
    else:
        m = model.clone()
    outer = compat.wrapper_type("OUTER_SAMPLE")
    if outer is not None:
        earlier = next(
            (
                getattr(w, "__self__", None)
                for w in m.get_wrappers(outer, WRAPPER_KEY)
                if isinstance(getattr(w, "__self__", None), MemoryPoolPatch)
            ),
            None,
        )
        patch = MemoryPoolPatch(options, node_id, reports, earlier)
        compat.set_wrapper(m, "OUTER_SAMPLE", WRAPPER_KEY, patch.outer_sample_wrapper)
        compat.set_wrapper(m, "PREPARE_SAMPLING", WRAPPER_KEY, patch.prepare_sampling_wrapper)
        compat.set_wrapper(m, "CALC_COND_BATCH", WRAPPER_KEY, patch.calc_cond_batch_wrapper)
    cn = control_net
    if cn is not None and options.controlnet_weights != "as loaded":
        why = why_not_compressible(cn)
        if why is not None:
            logger.warning("Memory Pool: ControlNet %s; its weights stay as loaded", why)
        else:
            got, rep = _compress_or_not(
                control_net.control_model_wrapped, None, "ControlNet", options.controlnet_weights
            )
            if got is not None:
                cn = cn.copy()
                cn.control_model_wrapped = got
            reports.append(rep)
    return m, cn


def _compress_or_not(patcher, root_attr: str | None, what: str, mode: str = "int8"):
    """``compress_patcher``, or (None, a report saying why not) when memory runs out: the
    weights then stay as loaded and the workflow runs on."""
    failure = None
    try:
        return compress_patcher(patcher, root_attr, what, mode)
    except Exception as e:
        if not is_out_of_memory(e):
            raise
        failure = f"{type(e).__name__}: {status.short(str(e), 160)}"
    # here, not in the except block: the exception's frames hold the partial INT8 copies
    import comfy.model_management as mm

    mm.soft_empty_cache()
    logger.warning(
        "Memory Pool: out of memory while compressing the %s (%s); its weights stay as loaded",
        what,
        failure,
    )
    return None, CompressReport(what=what, mode=mode, failed=f"out of memory ({failure})")


def validate_inputs(model, control_net, options: PoolOptions) -> None:
    """Refuse what would only fail later, mid-sampling, or silently do nothing."""
    for name in ("unet_weights", "controlnet_weights"):
        v = getattr(options, name)
        if v not in WEIGHT_MODES:
            raise NodeInputError(
                NODE, name, f"is {v!r}", f"Choose one of {', '.join(map(repr, WEIGHT_MODES))}."
            )
    if control_net is None:
        return
    want = context_width(getattr(getattr(model, "model", None), "diffusion_model", None))
    got = context_width(getattr(control_net, "control_model", None))
    if want is not None and got is not None and want != got:
        raise NodeInputError(
            NODE,
            "control_net",
            f"is a {family(got)} ControlNet (text conditioning {got} wide) but 'model' is a "
            f"{family(want)} model ({want} wide)",
            "Load a ControlNet made for your checkpoint's model family.",
        )


def why_not_compressible(control_net) -> str | None:
    try:
        import comfy.controlnet as _cn
    except ImportError:  # pragma: no cover - host always present when nodes run
        return "cannot be inspected (ComfyUI not importable)"
    if not isinstance(control_net, _cn.ControlNet) or isinstance(control_net, _cn.ControlLora):
        return f"is a {type(control_net).__name__} (not a standard ControlNet)"
    wrapped = getattr(control_net, "control_model_wrapped", None)
    if wrapped is None or getattr(wrapped, "model", None) is not control_net.control_model:
        return "has no ModelPatcher around its network"
    return None
