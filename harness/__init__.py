# SPDX-License-Identifier: GPL-3.0-or-later
"""Test and benchmark harness: random-weight models, a headless runner, the quick benchmark.

Nothing here is imported by ComfyUI when it loads the pack; it serves ``tests/`` and
``benchmark.py``. Modules that need ComfyUI import it only after ``comfy_host.bootstrap()``.
"""
