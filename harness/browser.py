# SPDX-License-Identifier: GPL-3.0-or-later
"""A real ComfyUI server on 127.0.0.1 with this pack installed, and a headless Chromium driving
its front end (Debian's chromium + chromedriver, through selenium). Used by the end-to-end
browser test (``tests/e2e``) and by ``tools/make_thumbnails.py``.

The server runs from a throwaway base directory (``--base-directory``): ``custom_nodes`` holds
a link to this pack under its registry name, ``models`` links the tiny random-weight models
under the file names the example workflows use, ``input`` holds the control image.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

PACK_FOLDER = "comfyui-controlnet-accelerator"  # the name ComfyUI Manager clones it under
CHROMIUM = os.environ.get("CNA_CHROMIUM", "/usr/bin/chromium")
CHROMEDRIVER = os.environ.get("CNA_CHROMEDRIVER", "/usr/bin/chromedriver")


def missing_requirements(comfy_root: Path | None) -> str | None:
    """None if a browser test can run here, else what is missing (for a loud skip)."""
    if comfy_root is None:
        return "no ComfyUI tree"
    for exe in (CHROMIUM, CHROMEDRIVER):
        if not Path(exe).is_file():
            return f"{exe} not found (Debian packages chromium and chromium-driver)"
    return missing_server_packages(("selenium",))


def missing_server_packages(extra: tuple[str, ...] = ()) -> str | None:
    """None if ComfyUI's server can start here (its Python packages import), else what is
    missing. ``extra``: more packages the caller needs."""
    for mod in (*extra, "aiohttp", "comfyui_frontend_package", "sqlalchemy", "alembic", "PIL"):
        try:
            __import__(mod)
        except ImportError:
            return f"Python package {mod} not installed (ComfyUI's server needs it)"
    return None


def example_models(tiny: dict[str, Path]) -> dict[str, Path]:
    """The tiny random-weight models (``random_models.ensure_models`` paths) under the file
    names the example workflows reference, for ``prepare_base``. SD1.5-layout stand-ins serve
    the SDXL names too: the browser runs are about the front end, not the architecture."""
    from . import examples

    ck, a, b = tiny["sd15-tiny"], tiny["sd15-tiny-cn-a"], tiny["sd15-tiny-cn-b"]
    return {
        f"checkpoints/{examples.SD15_CKPT}": ck,
        f"checkpoints/{examples.SDXL_CKPT}": ck,
        f"controlnet/{examples.SD15_CANNY}": a,
        f"controlnet/{examples.SDXL_CANNY}": a,
        f"controlnet/{examples.SDXL_DEPTH}": b,
    }


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def prepare_base(base: Path, pack_root: Path, models: dict[str, Path], image: Path) -> Path:
    """Lay out a ComfyUI base directory. ``models`` maps 'checkpoints/<file>' or
    'controlnet/<file>' to the file to link there."""
    (base / "custom_nodes").mkdir(parents=True, exist_ok=True)
    link = base / "custom_nodes" / PACK_FOLDER
    if not link.exists():
        link.symlink_to(pack_root, target_is_directory=True)
    for rel, src in models.items():
        dst = base / "models" / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        if not dst.exists():
            dst.symlink_to(src)
    (base / "input").mkdir(exist_ok=True)
    shutil.copy(image, base / "input" / "example.png")
    # a returning user: no first-run tutorial or template dialog over the canvas
    settings = base / "user" / "default" / "comfy.settings.json"
    settings.parent.mkdir(parents=True, exist_ok=True)
    settings.write_text(
        json.dumps({"Comfy.TutorialCompleted": True, "Comfy.Validation.Workflows": True})
    )
    return base


# Starts ComfyUI's main.py with the torchaudio stand-in installed first (argv: main.py's own).
_LAUNCH = (
    "import runpy, sys, importlib.util as u; "
    "s = u.spec_from_file_location('torchaudio_standin', sys.argv.pop(1)); "
    "m = u.module_from_spec(s); s.loader.exec_module(m); m.install(force=True); "
    "sys.argv[0] = 'main.py'; runpy.run_path('main.py', run_name='__main__')"
)


def _main_py() -> list[str]:
    """How to start ComfyUI's ``main.py``: as is, or, where ``import torchaudio`` fails here,
    through a launcher that installs the import-only stand-in first (ComfyUI 0.33 imports
    torchaudio on the model-loading path; ``torchaudio_standin.py``)."""
    from . import torchaudio_standin

    if torchaudio_standin.needed() is None:
        return ["main.py"]
    return ["-c", _LAUNCH, str(Path(torchaudio_standin.__file__).resolve())]


class ComfyServer:
    """``python main.py --cpu`` (or on the GPU) as a child process; ``url`` once it answers."""

    def __init__(
        self,
        comfy_root: Path,
        base: Path,
        *,
        cpu: bool = True,
        env: dict | None = None,
        args: list[str] | tuple[str, ...] = (),
    ):
        self.comfy_root, self.base, self.cpu = Path(comfy_root), Path(base), cpu
        self.args = list(args)  # more main.py arguments, e.g. ["--cuda-device", "1"]
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = self.base / "server.log"
        self.env = {**os.environ, **(env or {})}
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> ComfyServer:
        cmd = (
            [
                sys.executable,
                *_main_py(),
                "--listen",
                "127.0.0.1",
                "--port",
                str(self.port),
                "--base-directory",
                str(self.base),
                "--disable-auto-launch",
            ]
            + (["--cpu"] if self.cpu else [])
            + self.args
        )
        self._log = open(self.log_path, "w")  # noqa: SIM115 - closed in __exit__
        self.proc = subprocess.Popen(
            cmd, cwd=self.comfy_root, stdout=self._log, stderr=subprocess.STDOUT, env=self.env
        )
        deadline = time.time() + 240
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"ComfyUI exited ({self.proc.returncode}):\n{self.log_tail()}")
            try:
                self.get("/system_stats")
                return self
            except OSError:
                time.sleep(0.5)
        raise TimeoutError(f"ComfyUI did not answer within 240 s:\n{self.log_tail()}")

    def __exit__(self, *exc) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=15)
        self._log.close()

    def log_tail(self, n: int = 60) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "(no log)"

    def get(self, path: str):
        with urllib.request.urlopen(self.url + path, timeout=10) as r:
            return json.loads(r.read().decode())


def chrome(user_data_dir: Path, width: int = 1600, height: int = 1000):
    """Headless Chromium under chromedriver, flags as this machine's probe used them (a closed
    network: no background connections)."""
    os.environ.setdefault("SE_OFFLINE", "true")  # never let selenium try to download a driver
    from selenium import webdriver

    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for a in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        f"--user-data-dir={user_data_dir}",
        f"--window-size={width},{height}",
    ):
        opts.add_argument(a)
    service = webdriver.ChromeService(executable_path=CHROMEDRIVER)
    return webdriver.Chrome(options=opts, service=service)


def wait_for(driver, script: str, timeout: float = 60.0, what: str = "condition"):
    """Poll ``return <script>`` in the page until it is truthy; return its value."""
    deadline = time.time() + timeout
    last = None
    while time.time() < deadline:
        try:
            last = driver.execute_script(f"return {script}")
        except Exception as e:  # page still loading
            last = e
        if last and not isinstance(last, Exception):
            return last
        time.sleep(0.25)
    raise TimeoutError(f"timed out waiting for {what} ({script!r}); last: {last!r}")


def open_app(driver, url: str) -> None:
    driver.get(url)
    wait_for(driver, "!!(window.app && window.app.graph && window.cnaBadges)", 120, "the app")


LOAD_TEMPLATE = """
const [module, name, done] = arguments;
(async () => {
  const r = await fetch(`/api/workflow_templates/${module}/${name}.json`);
  const wf = await r.json();
  await window.app.loadGraphData(wf, true, true, name);
  done(true);
})().catch(e => done(String(e)));
"""

SHRINK = """
// make the workflow CPU-quick: 64x64 latent, 2 steps (everything else as the template has it)
let n = 0;
for (const node of window.app.graph._nodes) {
  for (const w of node.widgets || []) {
    if (node.type === "EmptyLatentImage" && (w.name === "width" || w.name === "height")) {
      w.value = 64; n++;
    }
    if (w.name === "steps") { w.value = arguments[0]; n++; }
  }
}
window.app.graph.setDirtyCanvas(true, true);
return n;
"""

QUEUE = """
const done = arguments[arguments.length - 1];
window.app.queuePrompt(0, 1)
  .then(r => done(r === undefined ? true : r))
  .catch(e => done(String(e)));
"""


def wait_idle_and_result(server: ComfyServer, history_before: set, timeout: float = 300.0) -> dict:
    """Wait for the queue to empty and the new prompt's history entry; return it (raises with
    the server log when it failed or never came)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        q = server.get("/queue")
        hist = server.get("/history")
        new = [k for k in hist if k not in history_before]
        if new and not q.get("queue_running") and not q.get("queue_pending"):
            entry = hist[new[-1]]
            st = entry.get("status", {})
            if st.get("status_str") != "success":
                msgs = json.dumps(st.get("messages", []))[-3000:]
                raise RuntimeError(f"prompt failed: {msgs}\n{server.log_tail()}")
            return entry
        time.sleep(0.5)
    raise TimeoutError(f"prompt did not finish in {timeout} s:\n{server.log_tail()}")


def run_template(driver, server: ComfyServer, name: str, steps: int = 2) -> tuple[dict, list]:
    """Load one of the pack's templates through the template endpoint, shrink it to 64² and
    ``steps`` steps, queue it from the page and wait for it. Returns (history entry, the ids of
    the pack's nodes in the graph)."""
    ok = driver.execute_async_script(LOAD_TEMPLATE, PACK_FOLDER, name)
    if ok is not True:
        raise RuntimeError(f"loading template {name}: {ok}")
    broken = driver.execute_script(
        "return window.app.graph._nodes.filter(n => !n.comfyClass).map(n => n.type)"
    )
    if broken:  # e.g. the front end's model-loader bug when a core node failed to import
        raise RuntimeError(f"template {name}: the front end could not create {broken}")
    ours = driver.execute_script(
        "return window.app.graph._nodes"
        ".filter(n => n.type.startsWith('CNA_')).map(n => String(n.id))"
    )
    driver.execute_script("for (const k in window.cnaBadges) delete window.cnaBadges[k]")
    driver.execute_script(SHRINK, steps)
    before = set(server.get("/history"))
    driver.execute_async_script(QUEUE)
    return wait_idle_and_result(server, before, timeout=300), ours


def frame(driver, scale: float = 0.8) -> None:
    """Show the graph from its top-left corner at ``scale`` and redraw."""
    driver.execute_script(
        "const c = window.app.canvas; c.ds.scale = arguments[0]; c.ds.offset = [20, 20];"
        " window.app.graph.setDirtyCanvas(true, true)",
        scale,
    )
    time.sleep(0.5)
