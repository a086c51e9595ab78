# SPDX-License-Identifier: GPL-3.0-or-later
"""An import-only stand-in for ``torchaudio``, for ComfyUI trees that import it on start-up.

ComfyUI 0.33 imports torchaudio at module level on the model-loading path (``comfy/sd.py`` →
the LTX audio VAE), although Stable Diffusion and its ControlNets never call it. Where no
torchaudio build matches the installed torch, ``install()`` puts this stand-in in
``sys.modules`` so ComfyUI imports; anything that actually *uses* torchaudio (calls a function,
builds a transform, subclasses one) gets ``TorchaudioUnavailable`` saying so.

Only the harness installs it, and only when ``import torchaudio`` fails: a working torchaudio
always wins. It must not import torch (ComfyUI's ``main.py`` warns when torch is imported
before its own start-up code), so it is safe to install before ComfyUI starts.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import sys
import types

SUBMODULES = ("functional", "transforms", "io", "compliance", "compliance.kaldi", "models")
MARK = "__cna_standin__"


class TorchaudioUnavailable(ImportError):
    """Raised when code reaches the stand-in: torchaudio itself is needed for that."""


def _fail(name: str):
    raise TorchaudioUnavailable(
        f"{name} was called, but torchaudio is not installed (an import-only stand-in took its "
        "place so ComfyUI could start). Install a torchaudio build matching your torch to use "
        "ComfyUI's audio nodes and models."
    )


class _Missing:
    """What any torchaudio attribute resolves to: fails when called or subclassed."""

    def __init__(self, name: str):
        self._name = name

    def __call__(self, *args, **kwargs):
        _fail(self._name)

    def __getattr__(self, attr: str):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Missing(f"{self._name}.{attr}")

    def __mro_entries__(self, bases):
        _fail(self._name)

    def __repr__(self) -> str:
        return f"<torchaudio stand-in {self._name}>"


class _StandinModule(types.ModuleType):
    def __getattr__(self, attr: str):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Missing(f"{self.__name__}.{attr}")


def _module(name: str) -> types.ModuleType:
    m = _StandinModule(name)
    m.__path__ = []  # a package: ``import torchaudio.functional`` finds the entries below
    # a spec without a loader: find_spec() answers (transformers asks), no distribution behind it
    m.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
    m.__version__ = "0.0.0+unavailable"
    setattr(m, MARK, True)
    return m


def is_standin(module) -> bool:
    return bool(getattr(module, MARK, False))


def needed() -> str | None:
    """Why the stand-in is needed (the import error), or None when torchaudio imports."""
    if "torchaudio" in sys.modules:
        return "the stand-in is installed" if is_standin(sys.modules["torchaudio"]) else None
    try:
        if importlib.util.find_spec("torchaudio") is None:  # no import (and no torch import)
            return "No module named 'torchaudio'"
        importlib.import_module("torchaudio")
    except Exception as e:  # missing, or a build for another torch (OSError, undefined symbol)
        for key in [k for k in sys.modules if k == "torchaudio" or k.startswith("torchaudio.")]:
            del sys.modules[key]
        return f"{type(e).__name__}: {e}"
    return None


def install(force: bool = False) -> str | None:
    """Install the stand-in if ``import torchaudio`` fails (``force``: without trying, because
    the caller already did); returns why it was needed, or None when a real torchaudio (or the
    stand-in already) is in place."""
    if is_standin(sys.modules.get("torchaudio")):
        return "the stand-in is installed"
    why = "forced by the caller" if force and "torchaudio" not in sys.modules else needed()
    if why is None:
        return None
    root = _module("torchaudio")
    sys.modules["torchaudio"] = root
    for sub in SUBMODULES:
        full = f"torchaudio.{sub}"
        mod = _module(full)
        sys.modules[full] = mod
        parent, _, leaf = full.rpartition(".")
        setattr(sys.modules[parent], leaf, mod)
    return why
