# SPDX-License-Identifier: GPL-3.0-or-later
"""The quick benchmark, in one command: ``python benchmark.py`` (``--help`` lists every mode
and every option); ``python benchmark.py --kernels`` runs the kernel microbenchmark instead (GPU
only); ``python benchmark.py --mem-breakdown`` where the peak VRAM of a run goes (GPU only);
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

# benchmark.py's modes: flag -> the harness module whose ``main(argv)`` runs it.
MODE_MODULES = {
    "--kernels": "kernel_bench",
    "--soak": "soak",
    "--mem-breakdown": "mem_breakdown",
}


def _mode_main(flag: str):
    import importlib

    mod = importlib.import_module(f"comfyui_controlnet_accelerator.harness.{MODE_MODULES[flag]}")
    return mod.main


def full_help() -> str:
    """The quick benchmark's help, then every mode's own options: ``--help`` lists them all."""
    import contextlib
    import io

    from comfyui_controlnet_accelerator.harness.quick import build_parser

    parts = [build_parser().format_help()]
    for flag in MODE_MODULES:
        buf = io.StringIO()
        argv0, sys.argv[0] = sys.argv[0], f"benchmark.py {flag}"  # argparse's default prog
        try:
            with contextlib.redirect_stdout(buf), contextlib.suppress(SystemExit):
                _mode_main(flag)(["--help"])
        finally:
            sys.argv[0] = argv0
        parts.append(f"--- python benchmark.py {flag} [options] ---\n{buf.getvalue().rstrip()}")
    return "\n\n".join(parts) + "\n"


def main(argv: list[str]) -> int:
    modes = [a for a in argv if a in MODE_MODULES]
    if len(modes) > 1:
        print(f"benchmark.py: choose one mode, not {' and '.join(modes)}", file=sys.stderr)
        return 2
    if modes:
        flag = modes[0]
        sys.argv[0] = f"benchmark.py {flag}"  # the mode's usage line names the mode
        return _mode_main(flag)([a for a in argv if a != flag])
    if "-h" in argv or "--help" in argv:
        sys.stdout.write(full_help())
        return 0
    from comfyui_controlnet_accelerator.harness.quick import main as quick_main

    return quick_main(argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
