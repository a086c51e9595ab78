# SPDX-License-Identifier: GPL-3.0-or-later
"""The suite's memory guard (tests/_rss_guard.py) fails a run that grows past its bound, in the
pytest process or in processes it starts, and names the test."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

GUARD = Path(__file__).resolve().parents[1] / "_rss_guard.py"

CONFTEST = f"""
import importlib.util, sys
spec = importlib.util.spec_from_file_location("guard_under_test", {str(GUARD)!r})
guard = importlib.util.module_from_spec(spec)
spec.loader.exec_module(guard)

def pytest_configure(config):
    guard.register(config)
"""

TESTS = """
import subprocess, sys, time

def test_small():
    assert True

def test_grows_here():
    global KEEP
    KEEP = b"x" * (400 * 1024 * 1024)

def test_after():
    assert True

def test_child_grows():
    code = "import time; b = b'x' * (400 * 1024 * 1024); time.sleep(3)"
    subprocess.run([sys.executable, "-c", code], check=True)
"""


def _run(tmp_path: Path, bound: str, *select: str) -> subprocess.CompletedProcess:
    (tmp_path / "conftest.py").write_text(CONFTEST)
    (tmp_path / "test_mem.py").write_text(TESTS)
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    env = {**os.environ, "CNA_TEST_MAX_RSS_GB": bound}
    env.pop("CNA_TEST_RSS_LOG", None)
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *select],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_a_run_past_the_bound_fails_and_names_the_test(tmp_path):
    out = _run(tmp_path, "0.3", "test_mem.py::test_small", "test_mem.py::test_grows_here")
    text = out.stdout + out.stderr
    assert out.returncode == 1, text
    assert "memory bound exceeded after test_mem.py::test_grows_here" in text, text
    assert "past the bound of 0.30 GB" in text
    assert "peak RSS: pytest process" in text


def test_a_child_process_past_the_bound_fails_the_run(tmp_path):
    out = _run(tmp_path, "0.3", "test_mem.py::test_child_grows")
    text = out.stdout + out.stderr
    assert out.returncode == 1, text
    assert "memory bound exceeded after test_mem.py::test_child_grows" in text, text


def test_a_run_within_the_bound_passes_and_reports_its_peak(tmp_path):
    out = _run(tmp_path, "4", "test_mem.py")
    text = out.stdout + out.stderr
    assert out.returncode == 0, text
    assert "4 passed" in text and "bound 4.00 GB" in text
    assert "memory bound exceeded" not in text


def test_zero_turns_the_guard_off(tmp_path):
    out = _run(tmp_path, "0", "test_mem.py::test_grows_here")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "bound off" in out.stdout
