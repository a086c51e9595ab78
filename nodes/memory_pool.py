# SPDX-License-Identifier: GPL-3.0-or-later
"""ControlNet Memory Pool: ComfyUI glue for the memory levers (``memory/weight_compress.py``).

What it does to a workflow's models, through ComfyUI's own extension points only:

- **Compressed weights.** A clone of the MODEL's (and of the ControlNet's) ModelPatcher with one
  *object patch* per large Linear/Conv2d: while the clone is loaded the layer is an int8 module
  (``Int8Conv2d``/``Int8Linear``) and the fp16 original is out of the model tree, so ComfyUI's
  loader moves only the int8 bytes to the GPU. Unpatching (another clone taking over, unload)
  puts the originals back: stock nodes sharing the checkpoint never see int8 weights. The clone
  reports its real, smaller size to ComfyUI's memory manager (``ModelPatcher.size``) and gets a
  new ``patches_uuid``, so when it is loaded over a clone whose fp16 weights sit on the GPU,
  ComfyUI unpatches those first (they go back to the offload device) instead of keeping both.
- **Idle models out of the way.** Optionally, before sampling, unload from the GPU every model
  this sampling run does not use (typically the text encoder and the VAE, which ComfyUI keeps
  resident); ComfyUI loads them again when a later node needs them.
- **Report.** Peak allocated and reserved VRAM of each sampling run, logged and kept in
  ``LAST_RUN`` for the front end.

Weights that a LoRA patches are never compressed: the node skips layers with weight patches,
and at sampling time (``OUTER_SAMPLE``) the model actually sampled is checked again, so a LoRA
added *after* this node also keeps its layers in fp16 (one log line says how many).
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
from ..memory import weight_compress as wc
from . import status
from .fused_apply import context_width, family

WRAPPER_KEY = "cna_memory_pool"
NODE = "ControlNet Memory Pool"
MiB = 1024 * 1024

LAST_RUN: dict = {}  # figures of the last sampling run, for the front end
_lock = threading.Lock()
# original module -> (weight key, compressed module); dropped with the module
_COMPRESSED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


@dataclasses.dataclass(frozen=True)
class PoolOptions:
    unet_weights: str = "int8"  # "int8" | "as loaded"
    controlnet_weights: str = "int8"
    offload_idle_models: bool = False


WEIGHT_MODES = ("int8", "as loaded")


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


def _compressed_module(patcher, name: str, module, made: list) -> torch.nn.Module:
    w = _original(patcher, f"{name}.weight", module.weight)
    b = _original(patcher, f"{name}.bias", module.bias)
    key = _weight_key(w)
    with _lock:
        hit = _COMPRESSED.get(module)
    if hit is not None and hit[0] == key:
        return hit[1]
    try:
        c = wc.compress(module, _on_compute_device(patcher, w), b)
    except Exception as e:  # no room on the GPU for one layer: the CPU does it, slower
        if not is_out_of_memory(e):
            raise
        c = wc.compress(module, w, b)
    c = c.to(patcher.offload_device)
    with _lock:
        _COMPRESSED[module] = (key, c)
    made.append(module)
    return c


def _on_compute_device(patcher, w: torch.Tensor) -> torch.Tensor:
    """``w`` on the model's GPU, where quantizing it takes milliseconds: an unloaded
    ControlNet's weights sit on the CPU, where the same fp32 arithmetic took 8-12 s per SD1.5
    ControlNet (the H200 soak, 2026-11-30). One layer at a time, so the GPU holds one layer's
    fp32 copy at most (if even that does not fit, the caller quantizes on the CPU); the int8
    result goes back to the offload device like the original."""
    dev = getattr(patcher, "load_device", None)
    if isinstance(dev, torch.device) and dev.type == "cuda" and w.device != dev:
        return w.detach().to(dev, non_blocking=False)
    return w


@dataclasses.dataclass
class CompressReport:
    what: str = ""
    failed: str | None = None  # why the weights stayed as loaded (out of memory)
    layers: int = 0
    skipped_patched: int = 0
    bytes_before: int = 0
    bytes_after: int = 0
    seconds: float = 0.0

    def line(self, what: str) -> str:
        return (
            f"{what}: {self.layers} layers int8, weights {self.bytes_before / MiB:.0f} → "
            f"{self.bytes_after / MiB:.0f} MiB"
            + (f", {self.skipped_patched} LoRA-patched layers kept" if self.skipped_patched else "")
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


def compress_patcher(patcher, root_attr: str | None, what: str):
    """A clone of ``patcher`` whose large layers under ``patcher.model.<root_attr>`` (the whole
    model when None) are int8 while it is loaded. Returns (clone, report)."""
    t0 = time.perf_counter()
    root = patcher.model if root_attr is None else getattr(patcher.model, root_attr)
    prefix = "" if root_attr is None else f"{root_attr}."
    patched = _patched_keys(patcher)
    rep = CompressReport(what=what)
    clone = patcher.clone()
    made: list = []  # modules compressed by this call: forgotten again if it fails
    try:
        for name, module in _layers(patcher, root, prefix):
            full = prefix + name
            if isinstance(patcher.object_patches.get(full), wc._Int8Weight):
                continue  # compressed by an earlier Memory Pool node (counted in its size)
            if f"{full}.weight" in patched or f"{full}.bias" in patched:
                rep.skipped_patched += 1
                continue
            c = _compressed_module(patcher, full, module, made)
            clone.add_object_patch(full, c)
            rep.layers += 1
            rep.bytes_before += c.original_bytes()
            rep.bytes_after += c.compressed_bytes()
    except BaseException:
        with _lock:
            for module in made:
                _COMPRESSED.pop(module, None)
        raise
    if rep.layers:
        clone.size = max(1, patcher.model_size() - rep.bytes_before + rep.bytes_after)
        clone.patches_uuid = uuid.uuid4()
    rep.seconds = time.perf_counter() - t0
    logger.info("Memory Pool: %s", rep.line(what))
    return clone, rep


def _drop_patched_layers(patcher) -> int:
    """At sampling time: object patches of ours on layers that some later node (a LoRA) patches
    are dropped from this run's patcher, so the LoRA applies to the fp16 weight."""
    patched = _patched_keys(patcher)
    if not patched:
        return 0
    drop = [
        k
        for k, v in patcher.object_patches.items()
        if isinstance(v, wc._Int8Weight) and (f"{k}.weight" in patched or f"{k}.bias" in patched)
    ]
    for k in drop:
        c = patcher.object_patches.pop(k)
        patcher.size = patcher.size - c.compressed_bytes() + c.original_bytes()
    return len(drop)


class MemoryPoolPatch:
    def __init__(self, options: PoolOptions, node_id=None, reports: list | None = None):
        self.options = options
        self.node_id = node_id  # the node whose badge gets the run's figures
        self.reports = reports if reports is not None else []  # CompressReports of its weights
        self._offloaded: list[str] = []

    def outer_sample_wrapper(self, executor, *args, **kwargs):
        guider = executor.class_obj
        patcher = getattr(guider, "model_patcher", None)
        if patcher is not None:
            n = _drop_patched_layers(patcher)
            if n:
                logger.info("Memory Pool: %d layers patched by a LoRA after this node stay fp16", n)
        try:
            _park_originals(guider)
        except Exception as e:  # never fail the run over memory placement
            logger.warning("Memory Pool: could not move replaced weights off the GPU (%s)", e)
        self._offloaded = []
        if self.options.offload_idle_models:
            try:
                self._offloaded = _offload_idle(guider)
            except Exception as e:  # a newer ComfyUI's memory manager: never fail the run
                logger.warning("Memory Pool: could not offload idle models (%s)", e)
        dev = getattr(patcher, "load_device", None)
        cuda = isinstance(dev, torch.device) and dev.type == "cuda" and torch.cuda.is_available()
        if cuda:
            torch.cuda.reset_peak_memory_stats(dev)
        ok = False
        try:
            out = executor(*args, **kwargs)
            ok = True
            return out
        finally:
            if cuda:
                fig = {
                    "peak_allocated_mib": torch.cuda.max_memory_allocated(dev) / MiB,
                    "peak_reserved_mib": torch.cuda.max_memory_reserved(dev) / MiB,
                    "completed": ok,
                }
                with _lock:
                    LAST_RUN.clear()
                    LAST_RUN.update(fig)
                logger.info(
                    "Memory Pool: sampling peak VRAM %.0f MiB allocated, %.0f MiB reserved",
                    fig["peak_allocated_mib"],
                    fig["peak_reserved_mib"],
                )
            if ok:
                self._report(fig if cuda else {"completed": ok})

    def _report(self, fig: dict) -> None:
        lines = []
        if "peak_allocated_mib" in fig:
            lines.append(
                f"peak VRAM {status.mib(fig['peak_allocated_mib'] * MiB)} "
                f"(reserved {status.mib(fig['peak_reserved_mib'] * MiB)})"
            )
        else:
            lines.append("peak VRAM: n/a (not on a CUDA GPU)")
        before = sum(r.bytes_before for r in self.reports)
        after = sum(r.bytes_after for r in self.reports)
        if before:
            lines.append(f"weights int8: {status.mib(before)} → {status.mib(after)}")
        failed = {r.what: r.failed for r in self.reports if r.failed}
        for what, why in failed.items():
            lines.append(f"{what} as loaded: {status.short(why, 40)}")
        if self._offloaded:
            lines.append("unloaded while sampling: " + ", ".join(self._offloaded))
        data = {**fig, "weights_before": before, "weights_after": after}
        if failed:
            data["int8_failed"] = failed
        data["offloaded"] = list(self._offloaded)
        status.report(self.node_id, "memory_pool", lines, data)


def _models_of_run(guider) -> list:
    """The ModelPatchers this sampling run loads: the model, its ControlNets and extras."""
    import comfy.sampler_helpers as sh

    patcher = guider.model_patcher
    models = [patcher]
    conds = getattr(guider, "conds", None) or {}
    extra, _ = sh.get_additional_models(conds, patcher.model_dtype())
    models += extra
    models += patcher.get_nested_additional_models()
    for m in list(models):
        models += list(m.model_patches_models())
    return models


def _park_originals(guider) -> None:
    """Move the fp16 layers our INT8 modules replace to the offload device before ComfyUI
    loads the run's models. They can sit on the GPU (ComfyUI loads a checkpoint straight to
    the GPU when it has more free VRAM than RAM, or a stock clone left them there); loading the
    INT8 copies beside them would hold both for a moment and set the peak."""
    moved = 0
    for p in _models_of_run(guider):
        backup = getattr(p, "object_patches_backup", {}) or {}
        for key, obj in getattr(p, "object_patches", {}).items():
            if not isinstance(obj, wc._Int8Weight):
                continue
            orig = backup.get(key)
            if orig is None:
                import comfy.utils

                orig = comfy.utils.get_attr(p.model, key)
            if isinstance(orig, wc._Int8Weight) or not isinstance(orig, torch.nn.Module):
                continue
            w = getattr(orig, "weight", None)
            if isinstance(w, torch.Tensor) and w.device != torch.device(p.offload_device):
                orig.to(p.offload_device)
                moved += 1
    if moved:
        import comfy.model_management as mm

        mm.soft_empty_cache()
        logger.info("Memory Pool: moved %d replaced fp16 layers off the GPU", moved)


def _offload_idle(guider) -> list[str]:
    """Unload from the sampling device every loaded model this run does not use."""
    import comfy.model_management as mm

    keep = {id(m.model) for m in _models_of_run(guider)}
    device = guider.model_patcher.load_device
    freed = []
    for i in range(len(mm.current_loaded_models) - 1, -1, -1):
        lm = mm.current_loaded_models[i]
        p = lm.model
        if p is None or lm.device != device or id(p.model) in keep:
            continue
        if lm.model_unload():
            freed.append(type(p.model).__name__)
            mm.current_loaded_models.pop(i)
    if freed:
        mm.soft_empty_cache()
        logger.info("Memory Pool: unloaded idle models for sampling: %s", ", ".join(freed))
    return freed


def apply_memory_pool(model, control_net, options: PoolOptions, node_id=None):
    """What the node does: (model, control_net) patched as ``options`` say."""
    import comfy.patcher_extension as pe

    m = model
    reports: list[CompressReport] = []
    validate_inputs(model, control_net, options)
    if options.unet_weights == "int8":
        if getattr(model.model, "diffusion_model", None) is None:
            logger.warning("Memory Pool: this MODEL has no diffusion_model; weights as loaded")
            m = model.clone()
        else:
            got, rep = _compress_or_not(model, "diffusion_model", "diffusion model")
            m = got if got is not None else model.clone()
            reports.append(rep)
    else:
        m = model.clone()
    if hasattr(pe, "WrappersMP") and hasattr(pe.WrappersMP, "OUTER_SAMPLE"):
        patch = MemoryPoolPatch(options, node_id, reports)
        m.remove_wrappers_with_key(pe.WrappersMP.OUTER_SAMPLE, WRAPPER_KEY)
        m.add_wrapper_with_key(pe.WrappersMP.OUTER_SAMPLE, WRAPPER_KEY, patch.outer_sample_wrapper)
    else:
        logger.warning("Memory Pool: this ComfyUI has no OUTER_SAMPLE wrapper; no VRAM report")
    cn = control_net
    if cn is not None and options.controlnet_weights == "int8":
        why = why_not_compressible(cn)
        if why is not None:
            logger.warning("Memory Pool: ControlNet %s; its weights stay as loaded", why)
        else:
            got, rep = _compress_or_not(control_net.control_model_wrapped, None, "ControlNet")
            if got is not None:
                cn = cn.copy()
                cn.control_model_wrapped = got
            reports.append(rep)
    return m, cn


def _compress_or_not(patcher, root_attr: str | None, what: str):
    """``compress_patcher``, or (None, a report saying why not) when memory runs out: the
    weights then stay as loaded and the workflow runs on."""
    failure = None
    try:
        return compress_patcher(patcher, root_attr, what)
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
    return None, CompressReport(what=what, failed=f"out of memory ({failure})")


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
