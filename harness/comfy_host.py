# SPDX-License-Identifier: GPL-3.0-or-later
"""Find a ComfyUI tree and start it in-process, headless, with no web server.

ComfyUI is the host and is never vendored: it is looked up, in this order, at ``$COMFYUI_PATH``,
at the parent of the ``custom_nodes`` folder this pack sits in, and at ``~/comfy/ComfyUI``
(comfy-cli's default). ``bootstrap()`` must run before anything imports ``comfy.*``, because
ComfyUI reads its command-line options (``--cpu`` and friends) when ``comfy.model_management``
is first imported.

It starts ComfyUI the way its ``main.py`` does, on 0.3.64 and on 0.33: ComfyUI's own ``utils``
package is imported before ``nodes`` (which puts ``comfy/`` on ``sys.path``, where
``comfy/utils.py`` would otherwise shadow it and fail ComfyUI's own nodes that import
``utils.*``); where ``import torchaudio`` fails, an import-only stand-in takes its place
(``torchaudio_standin.py``: 0.33 imports torchaudio on the model-loading path, which SD never
calls); and on a GPU, DynamicVRAM is enabled as ``main.py`` enables it (0.33's default on NVIDIA
GPUs; ``CNA_DYNAMIC_VRAM=0`` turns it off like ``--disable-dynamic-vram``).
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
from dataclasses import dataclass
from pathlib import Path

PACK_ROOT = Path(__file__).resolve().parent.parent


class ComfyUINotFound(RuntimeError):
    pass


def default_models_dir() -> Path:
    """Where generated random-weight models are cached: $CNA_MODELS_DIR or the user cache."""
    env = os.environ.get("CNA_MODELS_DIR")
    if env:
        return Path(env).expanduser()
    return Path("~/.cache/comfyui-controlnet-accelerator/models").expanduser()


def _looks_like_comfyui(path: Path) -> bool:
    return (path / "comfy" / "model_management.py").is_file() and (path / "nodes.py").is_file()


def candidate_paths() -> list[tuple[str, Path]]:
    """Where ComfyUI is looked for, in order, with the reason for each place."""
    out: list[tuple[str, Path]] = []
    env = os.environ.get("COMFYUI_PATH")
    if env:
        out.append(("$COMFYUI_PATH", Path(env).expanduser()))
    if PACK_ROOT.parent.name == "custom_nodes":
        out.append(("custom_nodes parent", PACK_ROOT.parent.parent))
    out.append(("~/comfy/ComfyUI", Path("~/comfy/ComfyUI").expanduser()))
    return out


def find_comfyui() -> Path:
    """The ComfyUI tree to use, or ``ComfyUINotFound`` saying where it was looked for."""
    tried = []
    for why, path in candidate_paths():
        if _looks_like_comfyui(path):
            return path.resolve()
        tried.append(f"{why} ({path})")
    raise ComfyUINotFound(
        "ComfyUI not found; looked at "
        + ", ".join(tried)
        + ". Set COMFYUI_PATH to a ComfyUI checkout, or put one at ~/comfy/ComfyUI."
    )


@dataclass
class Host:
    """A started ComfyUI: its root, whether it runs on the CPU, and the pack's loaded module."""

    root: Path
    cpu: bool
    pack_module_name: str | None
    version: str | None = None  # ComfyUI's version (comfyui_version.py)
    dynamic_vram: bool = False  # models load through ModelPatcherDynamic (0.33 on a GPU)
    torchaudio_standin: str | None = None  # why the stand-in was installed, or None


_HOST: Host | None = None


class HeadlessServer:
    """What ComfyUI's executor, progress hooks and own nodes touch on ``PromptServer.instance``
    when no web server runs: messages go nowhere; 0.33's node-replacement registry is real."""

    client_id = None
    last_node_id = None
    last_prompt_id = None

    def __init__(self):
        self.sockets_metadata: dict = {}
        try:
            from app.node_replace_manager import NodeReplaceManager
        except ImportError:  # 0.3.64
            self.node_replace_manager = None
        else:
            self.node_replace_manager = NodeReplaceManager()

    def send_sync(self, *args, **kwargs):
        pass

    def send_progress_text(self, *args, **kwargs):
        pass

    def queue_updated(self):
        pass


def _headless_prompt_server() -> None:
    """main.py creates the web server before loading nodes, and some of ComfyUI's own nodes
    register with ``PromptServer.instance`` when they load (0.33's node replacements): here a
    ``HeadlessServer`` stands in. Without aiohttp ``server`` does not import and nodes that
    need it fail to import, as they would in ComfyUI."""
    try:
        import server
    except ImportError as e:
        logging.getLogger(__name__).info("ComfyUI's server module unavailable (%s)", e)
        return
    if getattr(server.PromptServer, "instance", None) is None:
        server.PromptServer.instance = HeadlessServer()


def bootstrap(
    *,
    cpu: bool | None = None,
    models_dir: Path | None = None,
    work_dir: Path | None = None,
    load_pack: bool = True,
    cuda_malloc: bool = True,
) -> Host:
    """Start ComfyUI in this process once; later calls return the same host.

    cpu: force ComfyUI's ``--cpu`` (default: when no CUDA device is visible).
    models_dir: a folder with ``checkpoints/`` and ``controlnet/`` added to ComfyUI's search paths.
    work_dir: where input/output/temp files go (default: a folder under the models dir).
    load_pack: load this pack through ComfyUI's own custom-node loader.
    cuda_malloc: select the cudaMallocAsync allocator as ComfyUI's ``main.py`` does (users run it).
    """
    global _HOST
    if _HOST is not None:
        return _HOST
    root = find_comfyui()
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))

    from comfy.cli_args import args  # argparse only: no torch yet

    if cpu is not None:
        args.cpu = bool(cpu)
    if os.environ.get("CNA_DYNAMIC_VRAM") == "0" and hasattr(args, "disable_dynamic_vram"):
        args.disable_dynamic_vram = True
    _load_aimdo(args)

    if cuda_malloc and cpu is not True and "PYTORCH_CUDA_ALLOC_CONF" not in os.environ:
        # main.py imports cuda_malloc before torch, which picks cudaMallocAsync on supported GPUs.
        # Once torch is imported the allocator backend is fixed (changing the variable then makes
        # CUDA's init fail), so a host started after torch keeps the native allocator.
        if "torch" not in sys.modules:
            import cuda_malloc  # noqa: F401

    from . import torchaudio_standin

    standin = torchaudio_standin.install()
    if standin is not None:
        logging.getLogger(__name__).info(
            "torchaudio unavailable (%s): an import-only stand-in lets ComfyUI start", standin
        )

    import torch

    if cpu is None:
        cpu = not torch.cuda.is_available()

    args.cpu = bool(cpu)
    args.disable_all_custom_nodes = False
    if os.environ.get("CNA_ATTENTION") == "pytorch":
        args.use_pytorch_cross_attention = True

    import folder_paths

    # main.py imports ComfyUI's own ``utils`` package before ``nodes`` puts ``comfy/`` first on
    # sys.path (where ``comfy/utils.py`` would shadow it), and sets up the MIME types (0.33)
    import utils.extra_config  # noqa: F401

    try:
        from utils.mime_types import init_mime_types
    except ImportError:  # 0.3.64
        pass
    else:
        init_mime_types()

    if models_dir is not None:
        for kind in ("checkpoints", "controlnet", "vae", "diffusion_models", "text_encoders"):
            sub = Path(models_dir) / kind
            sub.mkdir(parents=True, exist_ok=True)
            folder_paths.add_model_folder_path(kind, str(sub), is_default=True)
    if work_dir is None and models_dir is not None:
        work_dir = Path(models_dir).parent / "work"
    if work_dir is not None:
        for kind, setter in (
            ("input", folder_paths.set_input_directory),
            ("output", folder_paths.set_output_directory),
            ("temp", folder_paths.set_temp_directory),
        ):
            d = Path(work_dir) / kind
            d.mkdir(parents=True, exist_ok=True)
            setter(str(d))

    import comfy.utils  # noqa: F401  (main.py's order: comfy.utils, execution, server, nodes)
    import execution  # noqa: F401

    _headless_prompt_server()
    import nodes

    dynamic = _enable_dynamic_vram(args)
    asyncio.run(nodes.init_extra_nodes(init_custom_nodes=False, init_api_nodes=False))
    pack_module_name = None
    if load_pack:
        pack_module_name = load_pack_into_comfyui()
    _HOST = Host(
        root=root,
        cpu=bool(cpu),
        pack_module_name=pack_module_name,
        version=comfyui_version(root),
        dynamic_vram=dynamic,
        torchaudio_standin=standin,
    )
    return _HOST


def comfyui_version(root: Path | None = None) -> str | None:
    """The version in ``<root>/comfyui_version.py`` (read, not imported), or None."""
    import re

    try:
        root = find_comfyui() if root is None else Path(root)
        text = (root / "comfyui_version.py").read_text()
    except (OSError, ComfyUINotFound):
        return None
    m = re.search(r"__version__\s*=\s*[\"']([^\"']+)[\"']", text)
    return m.group(1) if m else None


def _load_aimdo(args) -> None:
    """ComfyUI 0.33's ``main.py`` loads comfy-aimdo's library before torch whenever
    ``enables_dynamic_vram()``; devices are initialised later (``_enable_dynamic_vram``)."""
    import comfy.cli_args as cli

    enables = getattr(cli, "enables_dynamic_vram", None)
    if enables is None or not enables():
        return
    try:
        import comfy_aimdo.control

        headroom = None if args.reserve_vram is None else int(args.reserve_vram * 1024**3)
        # memory pressure read through NVML (every process's use of the card), unless
        # --disable-nvml-pressure, as main.py asks; older comfy-aimdo takes fewer arguments
        nvml = not getattr(args, "disable_nvml_pressure", False)
        try:
            comfy_aimdo.control.init(simple_vram_headroom=headroom, nvml_pressure=nvml)
        except TypeError:
            try:
                comfy_aimdo.control.init(simple_vram_headroom=headroom)
            except TypeError:
                comfy_aimdo.control.init()
    except Exception as e:  # _enable_dynamic_vram then reports the legacy fallback
        logging.getLogger(__name__).debug("comfy-aimdo not loaded (%s)", e)


def _enable_dynamic_vram(args) -> bool:
    """DynamicVRAM as ComfyUI 0.33's ``main.py`` enables it: when ``enables_dynamic_vram()``
    (not --cpu, not --disable-dynamic-vram, ...) on an NVIDIA GPU with torch ≥ 2.8, through
    comfy-aimdo; ModelPatcherDynamic then loads every model. False where this ComfyUI has no
    DynamicVRAM (0.3.64), on the CPU, or when comfy-aimdo does not start (as main.py, which
    then falls back to the legacy ModelPatcher)."""
    import comfy.cli_args as cli

    enables = getattr(cli, "enables_dynamic_vram", None)
    if enables is None or not enables():
        return False
    import comfy.memory_management
    import comfy.model_management as mm
    import comfy.model_patcher

    if not (mm.is_nvidia() or getattr(args, "enable_dynamic_vram", False)):
        return False
    if mm.torch_version_numeric < (2, 8):
        return False
    log = logging.getLogger(__name__)
    try:
        import comfy_aimdo.control

        devices = list(mm.get_all_torch_devices())
        headroom = int(getattr(args, "vram_headroom", 0) * 1024**3)
        try:
            ok = comfy_aimdo.control.init_devices((d.index, headroom) for d in devices)
        except TypeError:
            ok = comfy_aimdo.control.init_devices(d.index for d in devices)
    except Exception as e:  # no working comfy-aimdo: the legacy ModelPatcher, as main.py does
        log.warning("DynamicVRAM not started (%s); using the legacy ModelPatcher", e)
        return False
    if not ok:
        log.warning("DynamicVRAM not started (comfy-aimdo); using the legacy ModelPatcher")
        return False
    comfy.model_patcher.CoreModelPatcher = comfy.model_patcher.ModelPatcherDynamic
    comfy.memory_management.aimdo_enabled = True
    log.info("DynamicVRAM enabled (as ComfyUI's main.py does on NVIDIA GPUs)")
    return True


def load_pack_into_comfyui() -> str:
    """Load this pack with ComfyUI's own custom-node loader; returns its ``sys.modules`` name.

    Raises if ComfyUI reports a failed import, so a broken pack never passes unnoticed.
    """
    import nodes

    before = set(nodes.NODE_CLASS_MAPPINGS)
    ok = asyncio.run(nodes.load_custom_node(str(PACK_ROOT)))
    if not ok:
        raise RuntimeError(f"ComfyUI failed to load the pack from {PACK_ROOT} (see the log above)")
    name = str(PACK_ROOT).replace(".", "_x_")
    if name not in sys.modules:
        raise RuntimeError(f"ComfyUI loaded the pack but not as module {name!r}")
    loaded = set(nodes.NODE_CLASS_MAPPINGS) - before
    sys.modules[name].LOADED_NODE_IDS = sorted(loaded)
    return name


def pack_module():
    """The pack as ComfyUI loaded it (so node classes are the ones ComfyUI runs)."""
    if _HOST is None or _HOST.pack_module_name is None:
        raise RuntimeError("bootstrap(load_pack=True) has not run")
    return sys.modules[_HOST.pack_module_name]
