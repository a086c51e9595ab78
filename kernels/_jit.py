# SPDX-License-Identifier: GPL-3.0-or-later
"""Build and load the pack's CUDA extension on first use (the only caller of
``torch.utils.cpp_extension.load``).

- Lazy: nothing is compiled until an op first runs on a CUDA tensor.
- For the current GPU's architecture only (``$CNA_CUDA_ARCH``, e.g. ``9.0``, overrides; CI uses
  it to compile without a GPU).
- Cached in ``$CNA_KERNELS_CACHE`` (default: torch's extensions folder), in a folder keyed by a
  hash of the sources, flags, Python/torch/CUDA versions and the architecture; a changed
  parameter builds a new folder and the log says what changed.
- Compiler jobs: each holds up to about 3 GB (nvcc and its children), so unless ``$MAX_JOBS``
  says otherwise a build runs only as many at once as the available memory leaves room for (at
  least one; the log says when that is fewer than torch would start), so a first build does
  not push the machine, and ComfyUI with it, out of memory.
- Two processes building at once: torch's file lock serialises them; a lock left by a crashed
  build (older than ``STALE_LOCK_S``) is removed with a warning.
- One status line before a first build, its duration after. A caller may ask for the build's
  progress (``ensure_loaded(on_progress=...)``): the compile then runs on a helper thread and
  the caller's thread reports each finished translation unit, and the link, as ``(done,
  total)``; a cached build reports nothing.
- Any failure (``$CNA_FORCE_EAGER=1``, no GPU, no nvcc, compile or load error) marks the cuda
  backend unavailable with the reason (one warning) and every op runs the eager path.
  ``$CNA_KERNELS_VERBOSE=1`` shows the compiler's output.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import shutil
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch

from ..logger import logger
from . import registry

CSRC = Path(__file__).resolve().parent / "csrc"
SOURCES = [
    "bindings.cpp",
    "ops/control_merge.cu",
    "ops/quant_int8.cu",
    "ops/group_norm_silu.cu",
    "ops/graph_if.cu",
]
HEADERS = ["common.cuh"]
# The C++ standard is left to torch (C++17 up to 2.12, C++20 from 2.13).
CFLAGS = ["-O3"]
NVCC_FLAGS = [
    "-O3",
    "-lineinfo",
    "-U__CUDA_NO_HALF_OPERATORS__",
    "-U__CUDA_NO_HALF_CONVERSIONS__",
    "-U__CUDA_NO_BFLOAT16_CONVERSIONS__",
]
STALE_LOCK_S = 15 * 60
PROGRESS_POLL_S = 0.5  # how often a reported build looks for finished object files
JOB_BYTES = 3 << 30  # one compiler job on these sources (nvcc and its children), at its peak
BUILD_RESERVE_BYTES = 2 << 30  # left free for everything else while the build runs

_lock = threading.Lock()
_module = None
_tried = False
_sources_hash: str | None = None


def cuda_home() -> str | None:
    """The CUDA toolkit to compile with: $CUDA_HOME/$CUDA_PATH, else the one holding nvcc."""
    for env in ("CUDA_HOME", "CUDA_PATH"):
        p = os.environ.get(env)
        if p and (Path(p) / "bin" / "nvcc").exists():
            return p
    cands = [Path("/usr/local/cuda")]
    nvcc = shutil.which("nvcc")
    if nvcc:
        real = Path(nvcc).resolve()
        cands.insert(0, real.parent.parent)
        try:  # a shell wrapper that execs the real nvcc (seen on our CI machine)
            text = real.read_text(errors="ignore")
            for tok in text.split():
                if tok.endswith("/bin/nvcc") and Path(tok).exists():
                    cands.insert(0, Path(tok).parent.parent)
        except (OSError, UnicodeDecodeError):
            pass
    for c in cands:
        if (c / "bin" / "nvcc").exists() and (c / "include" / "cuda_runtime.h").exists():
            return str(c)
    return None


def target_arch() -> str | None:
    env = os.environ.get("CNA_CUDA_ARCH")
    if env:
        return env
    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        return f"{major}.{minor}"
    return None


def sources_hash() -> str:
    """A hash of the kernel sources: the build cache key's part, and what a GPU validation is
    recorded against (``registry.VALIDATED_SOURCES``). Read once per process."""
    global _sources_hash
    if _sources_hash is None:
        h = hashlib.sha256()
        for rel in SOURCES + HEADERS:
            h.update(rel.encode())
            h.update((CSRC / rel).read_bytes())
        _sources_hash = h.hexdigest()[:16]
    return _sources_hash


def build_params(arch: str) -> dict:
    return {
        "sources": sources_hash(),
        "cflags": CFLAGS,
        "nvcc_flags": NVCC_FLAGS,
        "python": f"{sys.version_info.major}.{sys.version_info.minor}",
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "arch": arch,
    }


def available_memory_bytes() -> int | None:
    """Memory available to new processes without swapping (Linux's MemAvailable), or None
    where it cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def build_jobs(available: int | None = None, cpus: int | None = None) -> int | None:
    """How many compiler jobs a build may run at once, or None to leave it to torch (``$MAX_JOBS``
    set, or the available memory unknown). Never more than one per source or per CPU, never
    fewer than one."""
    if os.environ.get("MAX_JOBS"):
        return None
    available = available_memory_bytes() if available is None else available
    if available is None:
        return None
    cpus = cpus or os.cpu_count() or 1
    fits = (available - BUILD_RESERVE_BYTES) // JOB_BYTES
    return int(max(1, min(len(SOURCES), cpus, fits)))


def cache_root() -> Path:
    env = os.environ.get("CNA_KERNELS_CACHE")
    if env:
        return Path(env).expanduser()
    from torch.utils.cpp_extension import _get_build_directory

    return Path(_get_build_directory("cna_kernels", verbose=False)).parent / "cna_kernels"


def _clear_stale_lock(build_dir: Path) -> None:
    lock = build_dir / "lock"
    try:
        age = time.time() - lock.stat().st_mtime
    except FileNotFoundError:
        return
    if age > STALE_LOCK_S:
        logger.warning(
            "removing a stale build lock %s (%.0f min old, left by a crashed build)", lock, age / 60
        )
        lock.unlink(missing_ok=True)


def build(
    arch: str | None = None,
    verbose: bool | None = None,
    on_progress: Callable[[int, int], None] | None = None,
):
    """Compile (or reuse) and import the extension; raises on any failure. ``on_progress(done,
    total)`` is called from this thread while a fresh build compiles (see the module)."""
    arch = arch or target_arch()
    if arch is None:
        raise RuntimeError("no CUDA device visible (set CNA_CUDA_ARCH to compile without one)")
    home = cuda_home()
    if home is None:
        raise RuntimeError("no CUDA compiler found (nvcc not on PATH, CUDA_HOME unset)")
    os.environ.setdefault("CUDA_HOME", home)
    from torch.utils import cpp_extension

    if cpp_extension.CUDA_HOME is None or not Path(cpp_extension.CUDA_HOME, "bin", "nvcc").exists():
        cpp_extension.CUDA_HOME = home  # it resolved its own copy at import, before ours
    params = build_params(arch)
    key = hashlib.sha256(json.dumps(params, sort_keys=True).encode()).hexdigest()[:12]
    root = cache_root()
    build_dir = root / key
    build_dir.mkdir(parents=True, exist_ok=True)
    _clear_stale_lock(build_dir)
    _say_what_changed(root, params)
    name = f"cna_kernels_{key}"
    verbose = os.environ.get("CNA_KERNELS_VERBOSE") == "1" if verbose is None else verbose
    fresh = not any(build_dir.glob(f"{name}*.so")) and not any(build_dir.glob(f"{name}*.pyd"))
    if fresh:
        logger.info(
            "ControlNet Accelerator: compiling CUDA kernels for sm_%s (first use; about "
            "a minute, then cached in %s)",
            arch.replace(".", ""),
            build_dir,
        )
    t0 = time.perf_counter()
    prev_env = {k: os.environ.get(k) for k in ("TORCH_CUDA_ARCH_LIST", "MAX_JOBS")}
    os.environ["TORCH_CUDA_ARCH_LIST"] = arch
    jobs = build_jobs() if fresh else None
    if jobs is not None:
        os.environ["MAX_JOBS"] = str(jobs)
        if jobs < min(len(SOURCES), os.cpu_count() or 1):
            logger.info(
                "ControlNet Accelerator: %d compiler job(s) at once, as the free memory allows "
                "(set MAX_JOBS to choose)",
                jobs,
            )
    load = functools.partial(
        cpp_extension.load,
        name=name,
        sources=[str(CSRC / s) for s in SOURCES],
        extra_cflags=CFLAGS,
        extra_cuda_cflags=NVCC_FLAGS,
        extra_include_paths=[str(CSRC)],
        build_directory=str(build_dir),
        verbose=verbose,
        with_cuda=True,
    )
    try:
        mod = _load_reporting(load, build_dir, on_progress) if fresh and on_progress else load()
    finally:
        for k, v in prev_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    if fresh:
        logger.info(
            "ControlNet Accelerator: CUDA kernels built in %.1f s", time.perf_counter() - t0
        )
    (root / "last.json").write_text(json.dumps(params, indent=1))
    return mod


def _report(on_progress: Callable[[int, int], None], done: int, total: int) -> None:
    try:
        on_progress(done, total)
    except Exception as e:  # a progress bar must never break a build
        logger.debug("kernel build progress not shown: %s", e)


def _load_reporting(load: Callable, build_dir: Path, on_progress: Callable[[int, int], None]):
    """``load()`` on a helper thread while this one reports progress: one step per source
    whose object file the build wrote since it started, and one for the link and import. The
    helper's error, if any, is raised here."""
    total = len(SOURCES) + 1
    started = time.time() - 1.0  # file times may be coarser than the clock
    out: dict = {}

    def run() -> None:
        try:
            out["module"] = load()
        except BaseException as e:  # raised again on the caller's thread
            out["error"] = e

    worker = threading.Thread(target=run, name="cna-kernel-build", daemon=True)
    shown = 0
    _report(on_progress, 0, total)
    worker.start()
    while worker.is_alive():
        worker.join(PROGRESS_POLL_S)
        done = min(total - 1, _objects_written(build_dir, started))
        if done > shown:
            shown = done
            _report(on_progress, done, total)
    if "error" in out:
        raise out["error"]
    _report(on_progress, total, total)
    return out["module"]


def _objects_written(build_dir: Path, since: float) -> int:
    n = 0
    try:
        for f in build_dir.glob("*.o"):
            try:
                n += f.stat().st_mtime >= since
            except OSError:
                pass
    except OSError:
        pass
    return n


def _say_what_changed(root: Path, params: dict) -> None:
    try:
        last = json.loads((root / "last.json").read_text())
    except (OSError, ValueError):
        return
    changed = [f"{k}: {last.get(k)} -> {v}" for k, v in params.items() if last.get(k) != v]
    if changed:
        logger.info(
            "ControlNet Accelerator: kernel build parameters changed (%s); building anew",
            "; ".join(changed),
        )


def _gpu_visible() -> bool:
    return torch.cuda.is_available()


def ensure_loaded(on_progress: Callable[[int, int], None] | None = None):
    """The extension module, building it on first call; None (and cuda marked unavailable)
    when it cannot be had. Safe to call from several threads. ``on_progress``: see ``build``
    (only the call that builds reports)."""
    global _module, _tried
    if _tried:
        return _module
    with _lock:
        if _tried:
            return _module
        try:
            if os.environ.get("CNA_FORCE_EAGER") == "1":
                raise RuntimeError("CNA_FORCE_EAGER=1")
            if not _gpu_visible():
                raise RuntimeError("no CUDA device visible")
            _module = build(on_progress=on_progress) if on_progress else build()
        except Exception as e:  # any failure: one warning, eager from now on
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            registry.mark_unavailable("cuda", f"{type(e).__name__}: {first}")
            _module = None
        _tried = True
        return _module


def is_loaded() -> bool:
    return _module is not None


def reset_for_tests() -> None:
    global _module, _tried
    with _lock:
        _module, _tried = None, False
    registry.reset_unavailable("cuda")


def module():
    """The loaded extension (``ensure_loaded`` must have succeeded)."""
    m = ensure_loaded()
    if m is None:
        raise RuntimeError("the CUDA extension is not available: see list_backends()")
    return m


if __name__ == "__main__":  # pragma: no cover - a manual "build now" entry point
    import logging

    logging.basicConfig(level=logging.INFO)
    build(verbose=True)
    print("ok")
