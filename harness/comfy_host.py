# SPDX-License-Identifier: GPL-3.0-or-later
"""Find a ComfyUI tree and start it in-process, headless, with no web server.

ComfyUI is the host and is never vendored: it is looked up, in this order, at ``$COMFYUI_PATH``,
at the parent of the ``custom_nodes`` folder this pack sits in, and at ``~/comfy/ComfyUI``
(comfy-cli's default). ``bootstrap()`` must run before anything imports ``comfy.*``, because
ComfyUI reads its command-line options (``--cpu`` and friends) when ``comfy.model_management``
is first imported.
"""

from __future__ import annotations

import asyncio
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


_HOST: Host | None = None


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

    if cuda_malloc and cpu is not True and "PYTORCH_CUDA_ALLOC_CONF" not in os.environ:
        # main.py imports cuda_malloc before torch, which picks cudaMallocAsync on supported GPUs.
        # Once torch is imported the allocator backend is fixed (changing the variable then makes
        # CUDA's init fail), so a host started after torch keeps the native allocator.
        if "torch" not in sys.modules:
            import cuda_malloc  # noqa: F401

    import torch

    if cpu is None:
        cpu = not torch.cuda.is_available()

    from comfy.cli_args import args

    args.cpu = bool(cpu)
    args.disable_all_custom_nodes = False
    if os.environ.get("CNA_ATTENTION") == "pytorch":
        args.use_pytorch_cross_attention = True

    import folder_paths

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

    import nodes

    asyncio.run(nodes.init_extra_nodes(init_custom_nodes=False, init_api_nodes=False))
    pack_module_name = None
    if load_pack:
        pack_module_name = load_pack_into_comfyui()
    _HOST = Host(root=root, cpu=bool(cpu), pack_module_name=pack_module_name)
    return _HOST


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
