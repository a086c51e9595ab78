# SPDX-License-Identifier: GPL-3.0-or-later
"""Regenerate the template thumbnails (example_workflows/<name>.jpg) and docs/screenshot.png:
each example workflow is run in a real ComfyUI + headless Chromium on the tiny random-weight
models (CPU), so the pack's badges show on its nodes, then the canvas is captured.

    python tools/make_thumbnails.py [name ...]   (default: every example)

Needs what the browser test needs (tests/e2e): a ComfyUI tree, its server requirements,
selenium, and Debian's chromium + chromium-driver.
"""

import importlib.util
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != ROOT]
_spec = importlib.util.spec_from_file_location(
    "comfyui_controlnet_accelerator", ROOT / "__init__.py", submodule_search_locations=[str(ROOT)]
)
_pack = importlib.util.module_from_spec(_spec)
sys.modules["comfyui_controlnet_accelerator"] = _pack
_spec.loader.exec_module(_pack)

from comfyui_controlnet_accelerator.harness import (  # noqa: E402
    browser,
    comfy_host,
    examples,
    random_models,
)
from comfyui_controlnet_accelerator.harness import workflows as wf  # noqa: E402


def main(only: list[str]) -> int:
    from PIL import Image

    unknown = [n for n in only if n not in examples.EXAMPLES]
    if unknown:
        print(f"no such example: {', '.join(unknown)}", file=sys.stderr)
        return 2

    tmp = Path(tempfile.mkdtemp(prefix="cna-thumbs-"))
    host = comfy_host.bootstrap(models_dir=tmp / "models", cpu=True)
    why = browser.missing_requirements(host.root)
    if why:
        print(f"cannot run the browser: {why}", file=sys.stderr)
        return 2
    names = ["sd15-tiny", "sd15-tiny-cn-a", "sd15-tiny-cn-b"]
    paths = random_models.ensure_models(names, tmp / "models")
    import folder_paths

    inp = Path(folder_paths.get_input_directory())
    hint = inp / wf.write_hint_images(str(inp), wf.WORKLOADS["T1"])[0]
    base = browser.prepare_base(tmp / "base", ROOT, browser.example_models(paths), hint)
    with browser.ComfyServer(host.root, base) as srv:
        d = browser.chrome(tmp / "chromium", width=1700, height=1500)
        try:
            browser.open_app(d, srv.url)
            for name in only or list(examples.EXAMPLES):
                browser.run_template(d, srv, name)
                browser.wait_for(d, "Object.keys(window.cnaBadges).length > 0", 30, "badges")
                browser.frame(d, 0.62)  # (LiteGraph drops text below 0.6) the card's graph
                shot = tmp / f"{name}-small.png"
                d.save_screenshot(str(shot))
                small = Image.open(shot).convert("RGB")
                side = min(small.size[0] - 70, small.size[1] - 80, 1400)
                thumb = small.crop((70, 80, 70 + side, 80 + side)).resize((512, 512), Image.LANCZOS)
                browser.frame(d, 0.75)  # readable, for the README
                shot = tmp / f"{name}.png"
                d.save_screenshot(str(shot))
                img = Image.open(shot).convert("RGB")
                out = ROOT / "example_workflows" / f"{name}.jpg"
                thumb.save(out, "JPEG", quality=85)
                print(f"wrote {out.relative_to(ROOT)}")
                if name == "controlnet_sd15_all_techniques":
                    img.save(ROOT / "docs" / "screenshot.png")
                    print("wrote docs/screenshot.png")
        finally:
            d.quit()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
