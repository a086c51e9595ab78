# SPDX-License-Identifier: GPL-3.0-or-later
"""The quick benchmark, in one command: ``python benchmark.py`` (``--help`` for options);
``python benchmark.py --kernels`` runs the kernel microbenchmark instead (GPU only);
``python benchmark.py --mem-breakdown`` where the peak VRAM of a run goes (GPU only);
``python benchmark.py --soak`` the soak run through real ComfyUI servers (harness/soak.py).

This file runs as a script, never imported by ComfyUI. The pack root must not stay on sys.path
(its ``nodes/`` would shadow ComfyUI's ``nodes`` module), so the pack is imported by file path
under the name ``comfyui_controlnet_accelerator``.
"""

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != ROOT]
_spec = importlib.util.spec_from_file_location(
    "comfyui_controlnet_accelerator", ROOT / "__init__.py", submodule_search_locations=[str(ROOT)]
)
_pack = importlib.util.module_from_spec(_spec)
sys.modules["comfyui_controlnet_accelerator"] = _pack
_spec.loader.exec_module(_pack)

if __name__ == "__main__":
    if "--kernels" in sys.argv[1:]:  # the kernel microbenchmark (GPU only)
        from comfyui_controlnet_accelerator.harness.kernel_bench import main

        sys.exit(main([a for a in sys.argv[1:] if a != "--kernels"]))
    if "--mem-breakdown" in sys.argv[1:]:  # where one run's peak VRAM goes (GPU only)
        from comfyui_controlnet_accelerator.harness.mem_breakdown import main

        sys.exit(main([a for a in sys.argv[1:] if a != "--mem-breakdown"]))
    if "--soak" in sys.argv[1:]:  # the soak run through real ComfyUI servers
        from comfyui_controlnet_accelerator.harness.soak import main

        sys.exit(main([a for a in sys.argv[1:] if a != "--soak"]))
    from comfyui_controlnet_accelerator.harness.quick import main

    sys.exit(main())
