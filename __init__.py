# SPDX-License-Identifier: GPL-3.0-or-later
"""ControlNet Accelerator: a ComfyUI node pack that makes SD ControlNet inference faster and leaner.

ComfyUI imports this file when it loads ``custom_nodes``. It must stay cheap and must never raise
because CUDA, nvcc or a GPU is missing: everything heavy is imported inside ``comfy_entrypoint``.
Registration goes through the V3 extension entry point only (no ``NODE_CLASS_MAPPINGS``, which
would make ComfyUI take the old path and skip the entry point).
"""

from __future__ import annotations

__version__ = "0.1.0"

WEB_DIRECTORY = "./web"


async def comfy_entrypoint():
    from .nodes.extension import ControlNetAcceleratorExtension

    return ControlNetAcceleratorExtension()
