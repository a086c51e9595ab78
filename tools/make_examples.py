# SPDX-License-Identifier: GPL-3.0-or-later
"""Regenerate example_workflows/*.json from harness/examples.py: ``python tools/make_examples.py``.

Needs ComfyUI (node definitions); found as the tests find it."""

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() not in (ROOT, ROOT / "tools")]
_spec = importlib.util.spec_from_file_location(
    "comfyui_controlnet_accelerator", ROOT / "__init__.py", submodule_search_locations=[str(ROOT)]
)
_pack = importlib.util.module_from_spec(_spec)
sys.modules["comfyui_controlnet_accelerator"] = _pack
_spec.loader.exec_module(_pack)

from comfyui_controlnet_accelerator.harness import comfy_host, examples  # noqa: E402

if __name__ == "__main__":
    comfy_host.bootstrap(cpu=True)
    for p in examples.write_examples(ROOT / "example_workflows"):
        print("wrote", p.relative_to(ROOT))
