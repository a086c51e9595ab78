# SPDX-License-Identifier: GPL-3.0-or-later
"""The one compatibility seam between this pack and the ComfyUI versions it supports.

Supported: ComfyUI 0.3.64 and 0.33.0 (and the releases between them that keep these APIs).
Every version difference the pack depends on is answered here, so the rest of the pack calls
one function instead of testing versions. Where an API is missing, the function fails soft:
it does the stock thing and logs one line (once per process) saying what is left undone.

What differs, and how each is handled:

- **Wrapper signatures.** 0.33 passes more arguments to some wrappers (PREPARE_SAMPLING gets
  ``force_full_load`` and ``force_offload``; OUTER_SAMPLE gets ``latent_shapes``). The pack's
  wrappers take ``(executor, *args, **kwargs)`` and call ``executor(*args, **kwargs)``, so new
  arguments pass through untouched; ``prepare_sampling_args`` reads the four arguments every
  version passes, positional or keyword.
- **Executor arguments.** 0.33's ``PromptExecutor(server, cache_type, cache_args)`` reads
  ``cache_args["ram"]`` and ``["ram_inactive"]`` on every ``execute``; 0.3.64 has no
  ``cache_args``. ``prompt_executor`` builds one either way. 0.33's output cache answers
  ``get`` with a coroutine: ``cached_output``.
- **DynamicVRAM.** 0.33 loads models through ``ModelPatcherDynamic`` (comfy-aimdo) when
  ``main.py`` enables it: on NVIDIA GPUs by default, never with ``--cpu`` or
  ``--disable-dynamic-vram``. Weights of ComfyUI's own layers (``comfy_cast_weights``) are then
  faulted into VRAM as they run and evicted under pressure; other modules' parameters are
  loaded whole ("force pre-loaded"). ``is_dynamic`` and ``dynamic_vram_enabled`` tell.
- **DynamicVRAM and CUDA graphs.** A layer whose weights DynamicVRAM faults in per forward
  (``dynamic_layers``) is read at an address that stays valid only while ComfyUI's per-layer
  code keeps it faulted in; a graph replay skips that code. ``capture_blocker`` names the
  reason the pack's graphs run such a model eager.
- **Sampling a different patcher.** ``rest_of_chain_on_copy`` runs the rest of an
  OUTER_SAMPLE chain on a copy of the guider (``WrapperExecutor``, the same in both versions),
  so the Memory Pool can sample its own clone without editing the guider.
- **Memory management.** Unloading uses ``model_management.free_memory(..., keep_loaded=...)``
  (both versions) instead of editing ``current_loaded_models``: ``unload_models_of`` and
  ``unload_all_but``.

CUDA graphs: this pack's and ComfyUI 0.33's own. 0.33 captures CUDA graphs only in
``comfy/model_prefetch.py``'s ``prefetch_queue_pop`` when called with ``enable_graph=True``,
which only its LLM text encoders do during fixed-size KV decoding
(``comfy/text_encoders/llama.py`` and ``comfy/text_encoders/gemma4.py``), and only under
DynamicVRAM (``module._v_block`` set by ``ModelPatcherDynamic.load``) unless
``--disable-cuda-graphs``. The other callers of the prefetch queue (LTX-AV, MiniMax) pass no
``enable_graph``, and the SD1.5/SDXL UNet (``comfy/ldm/modules/diffusionmodules/
openaimodel.py``) and ControlNet (``comfy/cldm/cldm.py``) never use the prefetch queue at all. So
ComfyUI never captures the models this pack captures (the UNet step with its ControlNets), and
this pack never captures a text encoder: the two never capture the same model. They share the
GPU's memory: ComfyUI's graphs stay alive until ``cleanup_prefetch_queues`` drops them, and
its capture stream is separate from ours. ``comfyui_captures(model)`` answers the question for
a given diffusion model (False for every model that has no ``_comfy_graph`` anywhere in it), so
the pack can refuse a model that ComfyUI has already captured.
"""

from __future__ import annotations

import inspect
import threading

from ..logger import logger

_warned: set[str] = set()
_lock = threading.Lock()


def warn_once(key: str, msg: str, *args) -> None:
    """Log ``msg`` at warning level the first time ``key`` is seen in this process."""
    with _lock:
        if key in _warned:
            return
        _warned.add(key)
    logger.warning(msg, *args)


def info_once(key: str, msg: str, *args) -> None:
    with _lock:
        if key in _warned:
            return
        _warned.add(key)
    logger.info(msg, *args)


def comfyui_version() -> str | None:
    """ComfyUI's version string (``comfyui_version.py``), or None when it cannot tell."""
    try:
        import comfyui_version

        return str(comfyui_version.__version__)
    except Exception:  # an unusual install without the generated file
        return None


def version_tuple(v: str | None = None) -> tuple[int, ...]:
    """``"0.33.0"`` → ``(0, 33, 0)``; ``()`` when unknown."""
    v = comfyui_version() if v is None else v
    out = []
    for part in (v or "").split("."):
        digits = "".join(ch for ch in part if ch.isdigit())
        if not digits:
            break
        out.append(int(digits))
    return tuple(out)


# ---- wrappers -------------------------------------------------------------------------------


def wrapper_type(name: str) -> str | None:
    """``comfy.patcher_extension.WrappersMP.<name>``, or None (one log line) when missing."""
    import comfy.patcher_extension as pe

    wt = getattr(getattr(pe, "WrappersMP", None), name, None)
    if wt is None:
        warn_once(
            f"wrapper:{name}",
            "ControlNet Accelerator: this ComfyUI has no %s wrapper; what the pack does there "
            "is skipped",
            name,
        )
    return wt


def set_wrapper(patcher, name: str, key: str, fn) -> bool:
    """Replace ``patcher``'s wrapper ``key`` of type ``name`` with ``fn``; False (logged once)
    when this ComfyUI lacks that wrapper type."""
    wt = wrapper_type(name)
    if wt is None:
        return False
    patcher.remove_wrappers_with_key(wt, key)
    patcher.add_wrapper_with_key(wt, key, fn)
    return True


def rest_of_chain_on_copy(executor, **attrs):
    """Run the rest of a class wrapper chain (the later wrappers, then the method) on a shallow
    copy of ``executor.class_obj`` with ``attrs`` set, so that a wrapper can change what one
    call of the method sees without touching the object (a guider can be another node's cached
    output). Returns ``(copy, executor)``: call that executor as the one the wrapper was handed.
    None when the chain cannot be moved (its method is not bound to the object)."""
    import copy

    import comfy.patcher_extension as pe

    obj = getattr(executor, "class_obj", None)
    method = getattr(executor, "original", None)
    func = getattr(method, "__func__", None)
    if obj is None or func is None or getattr(method, "__self__", None) is not obj:
        return None
    twin = copy.copy(obj)
    for name, value in attrs.items():
        setattr(twin, name, value)
    bound = func.__get__(twin, type(twin))
    rest = pe.WrapperExecutor.new_class_executor(bound, twin, executor.wrappers, executor.idx)
    return twin, rest


_PREPARE_SAMPLING_NAMES = ("model", "noise_shape", "conds", "model_options")


def prepare_sampling_args(args: tuple, kwargs: dict) -> dict:
    """The arguments every version passes to a PREPARE_SAMPLING wrapper (after the executor),
    by name, wherever they came: ``model``, ``noise_shape``, ``conds``, ``model_options``."""
    got = dict(zip(_PREPARE_SAMPLING_NAMES, args, strict=False))
    for k in _PREPARE_SAMPLING_NAMES:
        if k in kwargs:
            got[k] = kwargs[k]
    got.setdefault("model_options", None)
    return got


# ---- executor -------------------------------------------------------------------------------


def prompt_executor(server, cache_type=None):
    """ComfyUI's ``PromptExecutor`` with the classic cache, on either signature: 0.33 needs
    ``cache_args`` (RAM-pressure headroom read on every execute: 0, as ``main.py`` sets it for
    the classic cache)."""
    import execution

    if cache_type is None:
        cache_type = execution.CacheType.CLASSIC
    params = inspect.signature(execution.PromptExecutor.__init__).parameters
    if "cache_args" in params:
        cache_args = {"lru": 0, "ram": 0, "ram_inactive": 0}
        return execution.PromptExecutor(server, cache_type=cache_type, cache_args=cache_args)
    return execution.PromptExecutor(server, cache_type=cache_type)


def cached_output(executor, node_id):
    """A node's entry in ``executor``'s output cache (None if absent): 0.33's cache ``get`` is a
    coroutine, 0.3.64's a plain call. Called outside an event loop (after ``execute``)."""
    got = executor.caches.outputs.get(str(node_id))
    if inspect.isawaitable(got):
        import asyncio

        got = asyncio.run(got)
    return got


# ---- DynamicVRAM ----------------------------------------------------------------------------


def dynamic_vram_enabled() -> bool:
    """Whether ComfyUI loads models through ModelPatcherDynamic (0.33+, enabled by main.py)."""
    try:
        import comfy.memory_management as cmm
    except ImportError:  # 0.3.64: no DynamicVRAM
        return False
    return bool(getattr(cmm, "aimdo_enabled", False))


def is_dynamic(patcher) -> bool:
    """Whether ``patcher`` is a DynamicVRAM patcher (weights faulted in as layers run)."""
    f = getattr(patcher, "is_dynamic", None)
    try:
        return bool(f()) if callable(f) else False
    except Exception:  # never fail a run over the question
        return False


def dynamic_layers(module) -> int:
    """How many layers under ``module`` have their weights managed by DynamicVRAM: those
    ``ModelPatcherDynamic.load`` gave a slice of the model's virtual VRAM range (``_v``). Their
    parameters stay where the checkpoint was loaded (system RAM, the file's dtype); each forward
    faults the slice in (``comfy_aimdo.model_vbar.vbar_fault``), copies the weight there when it
    is not resident, computes from it and unpins it, so the slice can be evicted whenever
    another allocation needs the memory. 0 for every model on 0.3.64, on the CPU, and for
    models loaded with DynamicVRAM off."""
    try:
        return sum(1 for m in module.modules() if getattr(m, "_v", None) is not None)
    except Exception:  # not a torch module
        return 0


def size_dynamic_range(patcher) -> bool:
    """Under DynamicVRAM, make ``patcher``'s network's virtual VRAM range now, at this
    (full-size) patcher's size. True when the range exists afterwards.

    ComfyUI 0.33 makes one range per network and device, shared by every clone, the first time
    a clone of it loads: ``model_size() * 10`` bytes (``ModelPatcherDynamic._vbar_get``). A
    Memory Pool clone reports a far smaller size (a streamed ControlNet: about 0.1%); loaded
    first, it would make a range too small for a stock clone of the same network loaded later
    (``ModelVBAR.alloc`` raises "VBAR OOM"). Without DynamicVRAM, or where this ComfyUI has no
    such range, nothing is done (False, logged once for the latter)."""
    if not is_dynamic(patcher):
        return False
    get = getattr(patcher, "_vbar_get", None)
    if not callable(get):
        warn_once(
            "vbar",
            "ControlNet Accelerator: this ComfyUI's DynamicVRAM has no per-network VRAM range "
            "to size; a Memory Pool clone loaded first sizes it",
        )
        return False
    try:
        return get(create=True) is not None
    except Exception as e:  # never fail the node over it; ComfyUI makes the range on load
        warn_once("vbar", "ControlNet Accelerator: could not size DynamicVRAM's range (%s)", e)
        return False


DYNAMIC_CAPTURE = (
    "ComfyUI's DynamicVRAM manages this model's weights (loaded as layers run, evictable "
    "between them): a CUDA graph cannot hold them, so it runs eager and gives no speed-up "
    "(measured slower than without the node); start ComfyUI with --disable-dynamic-vram to "
    "capture it"
)


DYNAMIC_PASS_THROUGH = (
    "ComfyUI's DynamicVRAM manages this model's weights (loaded as layers run, evictable "
    "between them): a CUDA graph cannot hold them, so the model is passed on unchanged and "
    "runs as without the node"
)
RESTART_ADVICE = "start ComfyUI with --disable-dynamic-vram to use the graphs"
TOO_LARGE_ADVICE = (
    "the graphs need the whole model on the GPU, which this one does not fit: DynamicVRAM's "
    "streaming is the better way to run it here"
)


class NoCopy(str):
    """Why no classic copy was made: the text, as logged and shown on the badge, with two
    facts about it. ``restart_helps``: whether ComfyUI started with --disable-dynamic-vram
    would let the graphs hold the model (it is then loaded whole, the classic way).
    ``lasting``: whether asking again for the same network gives the same answer (free RAM
    changes; a network's size or a failed copy does not)."""

    restart_helps: bool
    lasting: bool

    def __new__(cls, text: str, restart_helps: bool = True, lasting: bool = True):
        self = super().__new__(cls, text)
        self.restart_helps = restart_helps
        self.lasting = lasting
        return self


def restart_helps(why) -> bool:
    """Whether --disable-dynamic-vram would let the graphs run a model passed on for ``why``."""
    return getattr(why, "restart_helps", True)


def dynamic_pass_through(why: str | None) -> str:
    """What the CUDA Graph nodes say when they hand a DynamicVRAM model on unchanged: why no
    classic copy could be used (``classic_delegate``), then what to do, if anything: restarting
    with --disable-dynamic-vram is suggested only where the model would then load whole."""
    said = DYNAMIC_PASS_THROUGH if not why else f"{DYNAMIC_PASS_THROUGH} (no classic copy: {why})"
    return f"{said}; {RESTART_ADVICE if restart_helps(why) else TOO_LARGE_ADVICE}"


# ---- DynamicVRAM: classic copies for the graphs ---------------------------------------------

# A classic copy is used only for a network at most this share of the GPU's memory: a larger
# one would be loaded partly (lowvram), which no graph can hold either, and DynamicVRAM streams
# it better than the classic partial load.
CLASSIC_VRAM_SHARE = 0.5
# Above this share of the GPU's memory a model is loaded partly even with DynamicVRAM off
# (ComfyUI keeps room for the step's activations beside it), so restarting without DynamicVRAM
# would not give the graphs a whole model either.
WHOLE_LOAD_SHARE = 0.8
# System RAM a classic copy needs free, as a multiple of its weights (the copy itself, plus the
# state dict read from disk while it is built).
CLASSIC_RAM_FACTOR = 1.5
GiB = 1024**3


def _room_for(patcher, size: int, in_ram: bool) -> NoCopy | None:
    """Why a classic copy of ``size`` bytes of ``patcher``'s network does not fit, or None."""
    import comfy.model_management as mm
    import torch

    try:
        total = mm.get_total_memory(patcher.load_device)
    except Exception:  # an unknown device: leave the model to DynamicVRAM
        return NoCopy("this GPU's memory size is unknown")
    if size > CLASSIC_VRAM_SHARE * total:
        return NoCopy(
            f"its weights ({size / GiB:.1f} GiB) are over {CLASSIC_VRAM_SHARE:.0%} of this GPU's "
            f"{total / GiB:.1f} GiB, which DynamicVRAM streams better than a partial load",
            restart_helps=size <= WHOLE_LOAD_SHARE * total,
        )
    if in_ram:
        free = mm.get_free_memory(torch.device("cpu"))
        if free < CLASSIC_RAM_FACTOR * size:
            return NoCopy(
                f"a copy needs about {CLASSIC_RAM_FACTOR * size / GiB:.1f} GiB of free system "
                f"RAM and {free / GiB:.1f} GiB is free",
                lasting=False,
            )
    return None


def classic_delegate(patcher):
    """``(copy, None)`` or ``(None, why)``: a classic (not DynamicVRAM) ModelPatcher of the
    model ``patcher`` manages under DynamicVRAM, for the CUDA Graph nodes.

    It is ComfyUI's own non-dynamic delegate (``ModelPatcherDynamic.get_non_dynamic_delegate``,
    which CFGGuider uses for hooked conditioning): a clone with the same patches, wrappers and
    options whose diffusion model ComfyUI reads again from the checkpoint with DynamicVRAM off
    (the loader's ``cached_patcher_init``: the diffusion model only). ComfyUI keeps that model
    on ``patcher``, so later runs of the same loaded model do not read it again. It costs a
    second copy of the diffusion model in system RAM while the workflow holds both. ``None``
    when this ComfyUI has no delegate, the loader cannot load the model again (a custom loader),
    or the copy does not fit (``_room_for``); the model is then left to DynamicVRAM."""
    get = getattr(patcher, "get_non_dynamic_delegate", None)
    if not callable(get):
        return None, NoCopy("this ComfyUI cannot make one")
    if getattr(patcher, "cached_patcher_init", None) is None:
        return None, NoCopy("its loader cannot load it again (a custom loader)")
    try:
        size = int(patcher.model_size())
    except Exception as e:
        return None, NoCopy(f"its size is unknown ({e})")
    reload = getattr(patcher, "non_dynamic_delegate_model", None) is None
    why = _room_for(patcher, size, in_ram=reload)
    if why is not None:
        return None, why
    if reload:
        logger.info(
            "CUDA Graph: DynamicVRAM manages this model; reading its diffusion model again from "
            "the checkpoint as a classic copy the graphs can hold (%.1f GiB of system RAM, once "
            "per loaded model)",
            size / GiB,
        )
    try:
        got = get()
    except Exception as e:  # never fail the prompt: DynamicVRAM runs it
        return None, NoCopy(f"loading it failed ({type(e).__name__}: {e})")
    if is_dynamic(got):
        return None, NoCopy("ComfyUI gave a DynamicVRAM copy")
    return got, None


# What DynamicVRAM puts on each layer when it loads a network (``ModelPatcherDynamic.load``) and
# on the network itself (``ModelPatcherDynamic.__init__``, ``ModelPatcher.__init__``). A classic
# copy drops them: the layers then answer from their classes (``comfy.ops``: no cast, no weight
# functions), and a classic ModelPatcher starts the network's load bookkeeping afresh.
_DYNAMIC_LAYER_STATE = (
    "_v",
    "_v_block",
    "_v_signature",
    "_pin_state",
    "seed_key",
    "comfy_cast_weights",
    "prev_comfy_cast_weights",
    "weight_function",
    "bias_function",
    "weight_lowvram_function",
    "bias_lowvram_function",
)
_PATCHER_STATE = (
    "dynamic_vbars",
    "dynamic_pins",
    "dynamic_patchers",
    "model_loaded_weight_memory",
    "lowvram_patch_counter",
    "model_lowvram",
    "current_weight_patches_uuid",
    "model_offload_buffer_memory",
)


def classic_network(module):
    """A copy of a network DynamicVRAM manages, without DynamicVRAM's state (the copy's layers
    have their classes' settings, as a network a classic loader has not loaded yet).

    Every module is copied shallowly (same class, its own attribute dict) and every parameter
    and buffer is cloned on its own, so the copy takes exactly the network's weights in memory.
    It is not a deep copy: a weight that is a view of a larger storage (a loader's mapping of
    the whole file) would bring that whole storage along, and DynamicVRAM's state holds
    handles to its VRAM range and pinned buffers that belong to the original. Other attributes
    (settings, the layer classes' options) are shared with the original, which neither side
    changes while sampling."""
    import copy

    import torch

    tensors: dict[int, torch.Tensor] = {}  # id(original) -> clone: shared weights stay shared
    modules: dict[int, torch.nn.Module] = {}

    def tensor(t):
        if t is None:
            return None
        got = tensors.get(id(t))
        if got is None:
            c = t.detach().clone()
            if isinstance(t, torch.nn.Parameter):
                c = torch.nn.Parameter(c, requires_grad=t.requires_grad)
            got = tensors[id(t)] = c
        return got

    def twin_of(m):
        if m is None:
            return None
        got = modules.get(id(m))
        if got is not None:
            return got
        twin = modules[id(m)] = copy.copy(m)  # a new attribute dict with the same values
        d = vars(twin)
        for name in _DYNAMIC_LAYER_STATE + (_PATCHER_STATE if m is module else ()):
            d.pop(name, None)
        for name, value in list(d.items()):  # hook tables: the copy's own
            if "hooks" in name and isinstance(value, dict):
                d[name] = copy.copy(value)
        d["_parameters"] = {k: tensor(v) for k, v in m._parameters.items()}
        d["_buffers"] = {k: tensor(v) for k, v in m._buffers.items()}
        d["_modules"] = {k: twin_of(v) for k, v in m._modules.items()}
        return twin

    return twin_of(module)


def classic_control_patcher(patcher):
    """``(copy, None)`` or ``(None, why)``: a classic ModelPatcher over a classic copy of the
    ControlNet network ``patcher`` (a DynamicVRAM one) manages, as ComfyUI makes a ControlNet's
    copy for another GPU (``ControlNet.deepclone_multigpu``: a copy of the network in a plain
    ModelPatcher), without DynamicVRAM's state (``classic_network``). A network with weight or
    object patches on its patcher (the Memory Pool's) is left to DynamicVRAM."""
    import comfy.model_patcher

    if getattr(patcher, "patches", None) or getattr(patcher, "object_patches", None):
        return None, NoCopy("its patcher carries weight or object patches", lasting=False)
    try:
        size = int(patcher.model_size())
    except Exception as e:
        return None, NoCopy(f"its size is unknown ({e})")
    why = _room_for(patcher, size, in_ram=True)
    if why is not None:
        return None, why
    try:
        net = classic_network(patcher.model)
        got = comfy.model_patcher.ModelPatcher(
            net, load_device=patcher.load_device, offload_device=patcher.offload_device
        )
    except Exception as e:  # never fail the prompt: DynamicVRAM runs it
        return None, NoCopy(f"copying it failed ({type(e).__name__}: {e})")
    return got, None


def capture_blocker(module) -> str | None:
    """Why a CUDA graph must not capture ``module`` under this ComfyUI, or None.

    Under DynamicVRAM a captured step would read weights at addresses that are only valid
    while ComfyUI's per-layer code (which a replay skips) keeps them faulted in: a replay after
    an eviction reads unmapped or reused memory. Layers it loads whole (small ones, and the
    pack's own INT8 and streamed modules) are cast again at every load, so their addresses
    change from one sampling run to the next as well."""
    return DYNAMIC_CAPTURE if dynamic_layers(module) else None


# ---- memory management ----------------------------------------------------------------------


def loaded_patchers() -> list:
    """The ModelPatchers ComfyUI has loaded, most recent first (``loaded_models()``)."""
    import comfy.model_management as mm

    return [p for p in mm.loaded_models() if p is not None]


def _free(device, keep: list) -> list:
    """``free_memory`` asked to free everything on ``device`` except the loaded ``keep``; returns
    the patchers it unloaded."""
    import comfy.model_management as mm

    keep_loaded = [mm.LoadedModel(p) for p in keep]
    out = mm.free_memory(1e30, device, keep_loaded=keep_loaded)
    return [lm.model for lm in (out or []) if lm.model is not None]


def unload_models_of(patcher, device=None) -> list:
    """Unload, through ComfyUI's ``free_memory``, every loaded patcher that shares
    ``patcher``'s model (its clones) from ``device`` (default: its load device); nothing else.
    Returns the unloaded patchers; [] (logged once) when this ComfyUI's API does not fit."""
    device = patcher.load_device if device is None else device
    try:
        keep = [p for p in loaded_patchers() if p.model is not patcher.model]
        return _free(device, keep)
    except Exception as e:
        warn_once("free_memory", "ControlNet Accelerator: could not unload a model (%s)", e)
        return []


def unload_all_but(patchers, device) -> list:
    """Unload from ``device`` every loaded model whose network is not one of ``patchers``'
    (clones sharing a network are kept too). Returns the unloaded patchers."""
    try:
        nets = {id(p.model) for p in patchers}
        keep = [p for p in loaded_patchers() if id(p.model) in nets]
        return _free(device, keep)
    except Exception as e:
        warn_once("free_memory", "ControlNet Accelerator: could not unload idle models (%s)", e)
        return []


# ---- ComfyUI's own CUDA graphs --------------------------------------------------------------


def comfyui_captures(module) -> bool:
    """Whether ComfyUI's own CUDA-graph capture (0.33 ``comfy/model_prefetch.py``) holds a
    graph for ``module`` or any module inside it. False on 0.3.64 and for SD1.5/SDXL UNets and
    ControlNets (see the module docstring)."""
    try:
        return any(getattr(m, "_comfy_graph", None) is not None for m in module.modules())
    except Exception:  # not a torch module
        return False
