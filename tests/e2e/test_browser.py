# SPDX-License-Identifier: GPL-3.0-or-later
"""End to end in a real browser: a real ComfyUI server on 127.0.0.1 (its own front-end package
from the registry) with this pack installed, driven by headless Chromium.

For every example workflow: fetched from the template endpoint ComfyUI's template browser uses
and loaded into the canvas, shrunk to 64² and 2 steps (the tiny random-weight models on the
CPU), queued from the page, and then: the output image exists, and each of the pack's nodes
shows a badge with figures that came over ComfyUI's websocket. Screenshots go to
``test-artifacts/e2e/`` (or $CNA_TEST_ARTIFACTS). Also: the template browser lists the pack,
the badge setting exists, and the pack installs as ComfyUI Manager installs it (git clone into
a fresh custom_nodes, pip install -r requirements.txt, start) with no IMPORT FAILED.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
from comfyui_controlnet_accelerator.harness import browser, comfy_host, examples
from comfyui_controlnet_accelerator.harness import workflows as wf

ROOT = Path(__file__).resolve().parents[2]
try:
    COMFY_ROOT: Path | None = comfy_host.find_comfyui()
except comfy_host.ComfyUINotFound:
    COMFY_ROOT = None

pytestmark = pytest.mark.host

WHY_NOT = browser.missing_requirements(COMFY_ROOT)
needs_browser = pytest.mark.skipif(WHY_NOT is not None, reason=f"browser test: {WHY_NOT}")
ARTIFACTS = Path(os.environ.get("CNA_TEST_ARTIFACTS", ROOT / "test-artifacts")) / "e2e"
SETTING = "ControlNetAccelerator.ShowBadges"


@pytest.fixture(scope="module")
def server(host, tiny_models, tmp_path_factory):
    if WHY_NOT is not None:
        pytest.skip(f"browser test: {WHY_NOT}")
    import folder_paths

    inp = Path(folder_paths.get_input_directory())
    hint = inp / wf.write_hint_images(str(inp), wf.WORKLOADS["T1"])[0]
    base = browser.prepare_base(
        tmp_path_factory.mktemp("comfy_base"), ROOT, browser.example_models(tiny_models), hint
    )
    with browser.ComfyServer(COMFY_ROOT, base) as srv:
        yield srv


@pytest.fixture(scope="module")
def page(server, tmp_path_factory):
    d = browser.chrome(tmp_path_factory.mktemp("chromium"))
    try:
        browser.open_app(d, server.url)
        yield d
    finally:
        d.quit()


def _shot(driver, name: str) -> Path:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    path = ARTIFACTS / f"{name}.png"
    driver.save_screenshot(str(path))
    return path


@needs_browser
@pytest.mark.parametrize("name", list(examples.EXAMPLES))
def test_example_loads_from_templates_runs_and_shows_badges(server, page, name):
    listed = server.get("/workflow_templates").get(browser.PACK_FOLDER, [])
    assert name in listed, f"ComfyUI does not list {name} under {browser.PACK_FOLDER}: {listed}"
    out_dir = server.base / "output"
    before_files = set(out_dir.glob("*.png")) if out_dir.exists() else set()
    entry, ours = browser.run_template(page, server, name, steps=2)
    assert ours, "the example has none of the pack's nodes"
    images = [i for o in entry["outputs"].values() for i in o.get("images", [])]
    assert images, f"no image output: {entry['outputs']}"
    new_files = set(out_dir.glob("*.png")) - before_files
    assert any(p.name == images[0]["filename"] for p in new_files), (images, new_files)
    # the badges arrive over the websocket after the run
    badges = browser.wait_for(
        page,
        "(() => { const b = window.cnaBadges; const ids = arguments[0];"
        " return ids.every(i => b[i]) ? b : null })()".replace("arguments[0]", json.dumps(ours)),
        timeout=30,
        what="a badge on every node of the pack",
    )
    for nid in ours:
        text = " ".join(badges[nid]["lines"])
        assert any(ch.isdigit() for ch in text), (nid, badges[nid])
    browser.frame(page, 0.8)
    assert _shot(page, name).stat().st_size > 10_000


@needs_browser
def test_template_browser_lists_the_pack(server, page):
    """ComfyUI's own template dialog shows the pack (its module name in the sidebar) and, once
    picked, its example workflows."""
    page.execute_script("window.app.extensionManager.command.execute('Comfy.BrowseTemplates')")
    dialog = "document.querySelector('[role=dialog]')"
    browser.wait_for(
        page,
        f"{dialog} && {dialog}.innerText.includes('{browser.PACK_FOLDER}')",
        timeout=30,
        what="the pack in the template browser's sidebar",
    )
    clicked = page.execute_script(
        f"const els = [...{dialog}.querySelectorAll('*')]"
        f".filter(e => e.children.length === 0 && e.innerText?.trim() === '{browser.PACK_FOLDER}');"
        " if (!els.length) return false; els[0].click(); return true"
    )
    assert clicked
    names = browser.wait_for(
        page,
        f"(() => {{ const t = {dialog}.innerText; const n = arguments[0];"
        " return n.every(x => t.includes(x)) ? t : null })()".replace(
            "arguments[0]", json.dumps(list(examples.EXAMPLES))
        ),
        timeout=30,
        what="the pack's examples in the template browser",
    )
    assert all(n in names for n in examples.EXAMPLES)
    # each card shows its thumbnail (example_workflows/<name>.jpg, served by ComfyUI)
    for n in examples.EXAMPLES:
        url = f"{server.url}/api/workflow_templates/{browser.PACK_FOLDER}/{n}.jpg"
        with urllib.request.urlopen(url, timeout=10) as r:
            assert r.read(3) == b"\xff\xd8\xff", f"{n}.jpg is not a JPEG"
    # and the cards show them (the front end fetches each into a blob: URL); with the pack's
    # category picked, the dialog's images are its cards' thumbnails
    sizes = browser.wait_for(
        page,
        f"(() => {{ const imgs = [...{dialog}.querySelectorAll('img')];"
        f" return imgs.length === {len(examples.EXAMPLES)}"
        " && imgs.every(i => i.complete && i.naturalWidth > 0)"
        " ? imgs.map(i => [i.naturalWidth, i.naturalHeight]) : null })()",
        timeout=30,
        what="the pack's template thumbnails on the cards",
    )
    assert all(wh == [512, 512] for wh in sizes), sizes
    _shot(page, "template_browser")
    page.execute_script("document.dispatchEvent(new KeyboardEvent('keydown', {key: 'Escape'}))")
    page.execute_script(
        f"{dialog}?.querySelector('button[aria-label=Close], .p-dialog-close-button')?.click()"
    )


@needs_browser
def test_badge_setting_is_registered_and_can_be_turned_off(page):
    get = f"return window.app.extensionManager.setting.get('{SETTING}')"
    assert page.execute_script(get) is True  # on by default
    page.execute_async_script(
        f"const done = arguments[0]; window.app.extensionManager.setting.set('{SETTING}', false)"
        ".then(() => done(true)).catch(e => done(String(e)))"
    )
    assert page.execute_script(get) is False
    page.execute_async_script(
        f"const done = arguments[0]; window.app.extensionManager.setting.set('{SETTING}', true)"
        ".then(() => done(true)).catch(e => done(String(e)))"
    )


@needs_browser
def test_installs_like_comfyui_manager(host, tmp_path):
    """git clone into a fresh custom_nodes, pip install -r requirements.txt, start ComfyUI: the
    pack loads with no IMPORT FAILED and registers its nodes. Clones the committed HEAD."""
    base = tmp_path / "base"
    dest = base / "custom_nodes" / browser.PACK_FOLDER
    dest.parent.mkdir(parents=True)
    subprocess.run(["git", "clone", "-q", str(ROOT), str(dest)], check=True, timeout=120)
    pip = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--disable-pip-version-check",
            "-r",
            str(dest / "requirements.txt"),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert pip.returncode == 0, pip.stderr[-2000:]
    with browser.ComfyServer(COMFY_ROOT, base) as srv:
        info = srv.get("/object_info")
        log = srv.log_path.read_text(errors="replace")
    failed = [ln for ln in log.splitlines() if "IMPORT FAILED" in ln and browser.PACK_FOLDER in ln]
    assert not failed, failed
    ours = sorted(k for k in info if k.startswith("CNA_"))
    assert ours == sorted(
        [
            "CNA_ControlNetApplyFused",
            "CNA_ControlNetFeatureCache",
            "CNA_ControlNetMemoryPool",
            "CNA_CUDAGraph",
            "CNA_KSamplerCUDAGraph",
        ]
    ), ours
