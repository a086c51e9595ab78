# SPDX-License-Identifier: GPL-3.0-or-later
"""The pack's metadata and import contract; no ComfyUI needed."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    tomllib = pytest.importorskip("tomli", reason="Python 3.10 needs tomli to read pyproject")

ROOT = Path(__file__).resolve().parent.parent
ALLOWED_DEPS = {"torch", "safetensors", "numpy", "einops", "ninja"}


def _dep_name(spec: str) -> str:
    return re.split(r"[<>=!~;\[ ]", spec.strip(), maxsplit=1)[0].lower()


def test_pyproject_fields_for_manager_and_registry():
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())
    project = data["project"]
    assert project["name"] == "comfyui-controlnet-accelerator"
    assert re.fullmatch(r"\d+\.\d+\.\d+", project["version"])
    assert project["description"]
    assert project["license"] in ("GPL-3.0", "GPL-3.0-or-later") or project["license"].get("file")
    assert project["requires-python"] == ">=3.10"
    assert {_dep_name(d) for d in project["dependencies"]} <= ALLOWED_DEPS
    for key in ("Repository", "Issues", "Documentation"):
        assert project["urls"][key].startswith("https://")
    comfy = data["tool"]["comfy"]
    assert comfy["PublisherId"] and comfy["DisplayName"]
    assert comfy["Icon"].startswith("https://")
    assert comfy["requires-comfyui"].startswith(">=")


def test_requirements_mirror_runtime_dependencies():
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())
    lines = [ln.strip() for ln in (ROOT / "requirements.txt").read_text().splitlines()]
    reqs = sorted(ln for ln in lines if ln and not ln.startswith("#"))
    assert reqs == sorted(data["project"]["dependencies"])


def test_version_matches_package():
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())
    init = (ROOT / "__init__.py").read_text()
    assert f'__version__ = "{data["project"]["version"]}"' in init


def test_import_is_cheap_and_needs_no_comfyui_or_gpu():
    """Importing the pack imports neither ComfyUI nor torch, so it cannot fail for want of CUDA."""
    code = textwrap.dedent(f"""
        import importlib.util, sys
        spec = importlib.util.spec_from_file_location(
            "cna_probe", {str(ROOT / "__init__.py")!r}, submodule_search_locations=[{str(ROOT)!r}])
        m = importlib.util.module_from_spec(spec); sys.modules["cna_probe"] = m
        spec.loader.exec_module(m)
        heavy = sorted(k for k in sys.modules if k.split(".")[0] in ("torch", "comfy", "comfy_api"))
        assert not heavy, heavy
        assert m.WEB_DIRECTORY == "./web"
        assert not hasattr(m, "NODE_CLASS_MAPPINGS")
        print("ok")
    """)
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env={"PATH": ""}
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def test_every_source_file_has_spdx_header():
    missing = []
    for path in ROOT.rglob("*"):
        if path.suffix not in (".py", ".js", ".cu", ".cpp", ".h", ".cuh") or any(
            part.startswith(".") for part in path.relative_to(ROOT).parts
        ):
            continue
        if "SPDX-License-Identifier" not in path.read_text().splitlines()[0:2].__str__():
            missing.append(str(path.relative_to(ROOT)))
    assert not missing, missing


def test_comfy_registry_validation_passes_cleanly():
    """comfy-cli's `comfy node validate` (what the Comfy Registry runs on publish) accepts the
    pack with no security warning about our code."""
    cli = os.environ.get("CNA_COMFY_CLI") or shutil.which("comfy")
    if not cli:
        pytest.skip("comfy-cli not installed (.ci/run installs it into its own venv)")
    out = subprocess.run(
        [cli, "--skip-prompt", "--no-enable-telemetry", "node", "validate"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    text = out.stdout + out.stderr
    assert out.returncode == 0, text
    assert "All validation checks passed" in text, text
    assert "will soon disable" not in text and "error" not in text.lower(), text
