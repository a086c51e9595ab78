# SPDX-License-Identifier: GPL-3.0-or-later
"""The import-only torchaudio stand-in (``harness/torchaudio_standin.py``): ComfyUI 0.33's
imports of torchaudio succeed, and any use of it fails loudly. Each check runs in a fresh
interpreter where torchaudio is made unimportable, so nothing here touches this process's
modules (or a real torchaudio, if one is installed)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

STANDIN = Path(__file__).resolve().parents[2] / "harness" / "torchaudio_standin.py"

PRELUDE = f"""
import importlib.abc, importlib.util, sys

class _Block(importlib.abc.MetaPathFinder):  # torchaudio unimportable, as on a machine without it
    def find_spec(self, name, path=None, target=None):
        if name == "torchaudio" or name.startswith("torchaudio."):
            raise ModuleNotFoundError("No module named 'torchaudio'", name=name)

sys.meta_path.insert(0, _Block())
spec = importlib.util.spec_from_file_location("torchaudio_standin", {str(STANDIN)!r})
ts = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ts)
"""


def _run(body: str) -> subprocess.CompletedProcess:
    code = PRELUDE + textwrap.dedent(body)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


def test_installs_only_when_torchaudio_fails_and_never_imports_torch():
    r = _run(
        """
        why = ts.install()
        assert why and "torchaudio" in why, why
        assert "torch" not in sys.modules  # ComfyUI's main.py warns when torch comes early
        assert ts.install() == "the stand-in is installed"  # idempotent
        import torchaudio
        assert ts.is_standin(torchaudio)
        print("ok")
        """
    )
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr


def test_comfyuis_import_forms_work():
    """The forms ComfyUI 0.33 uses: plain, submodule alias, from-import, find_spec."""
    r = _run(
        """
        ts.install()
        import torchaudio
        import torchaudio.functional as AF
        from torchaudio.transforms import MelScale, MelSpectrogram
        assert importlib.util.find_spec("torchaudio") is not None
        assert AF is torchaudio.functional and callable(MelScale) and callable(MelSpectrogram)
        print("ok")
        """
    )
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr


def test_any_use_raises_a_clear_error():
    r = _run(
        """
        import types

        ts.install()
        import torchaudio
        from torchaudio.transforms import MelSpectrogram
        failures = []
        for use in (
            lambda: torchaudio.functional.resample(None, 16000, 44100),
            lambda: MelSpectrogram(sample_rate=16000),
            lambda: types.new_class("Sub", (MelSpectrogram,)),  # as a `class` statement does
            lambda: torchaudio.load("x.wav"),
        ):
            try:
                use()
            except ts.TorchaudioUnavailable as e:
                failures.append(str(e))
        assert len(failures) == 4, failures
        assert "torchaudio.functional.resample was called" in failures[0]
        assert all("not installed" in f and "Install a torchaudio build" in f for f in failures)
        print("ok")
        """
    )
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr


def test_a_working_torchaudio_is_never_replaced():
    """With a module already importable as torchaudio, install() leaves it alone."""
    r = _run(
        """
        sys.meta_path.pop(0)
        import types
        real = types.ModuleType("torchaudio")
        sys.modules["torchaudio"] = real
        assert ts.install() is None and sys.modules["torchaudio"] is real
        print("ok")
        """
    )
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr
