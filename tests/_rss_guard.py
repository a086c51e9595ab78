# SPDX-License-Identifier: GPL-3.0-or-later
"""A pytest plugin that fails the run when its memory grows past a bound.

The suite must fit the CI machine (2 cores, 24 GB). The bound is ``$CNA_TEST_MAX_RSS_GB``
(default 8; 0 turns the guard off) and applies to

- the pytest process's peak resident set (``VmHWM``, else ``ru_maxrss``; exact), and
- the pytest process together with every process it started that is alive at the same time
  (compiler runs, ComfyUI servers), sampled from ``/proc`` once a second: ``getrusage`` for
  children gives only the largest single child, not the sum of those running at once.

The first test after which a figure is past the bound fails, with both figures and the bound
in its report, so the test that grew the process is named; the terminal summary always prints
the peaks. ``$CNA_TEST_RSS_LOG=FILE`` appends each test's resident and peak figures to FILE.
"""

from __future__ import annotations

import os
import resource
import sys
import threading
from pathlib import Path

import pytest

GiB = 1024**3
PLUGIN_NAME = "cna_rss_guard"


def bound_bytes() -> int | None:
    """The bound from ``$CNA_TEST_MAX_RSS_GB`` (default 8), or None when set to 0."""
    raw = os.environ.get("CNA_TEST_MAX_RSS_GB", "8")
    try:
        gb = float(raw)
    except ValueError:
        raise pytest.UsageError(f"CNA_TEST_MAX_RSS_GB={raw!r} is not a number of GB") from None
    return None if gb <= 0 else int(gb * GiB)


def self_peak_bytes() -> int:
    """This process's peak resident set so far: ``VmHWM`` on Linux, else ``ru_maxrss``.

    Linux keeps ``ru_maxrss`` across exec, so a pytest started by a large process (a test that
    runs pytest in a child) would report its parent's size; ``VmHWM`` belongs to the process's
    own address space and starts afresh at exec."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def children_peak_bytes() -> int:
    """The largest peak of any finished child process that was waited for."""
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def _rss_of(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def tree_rss_bytes(root: int | None = None) -> int:
    """Resident bytes of ``root`` (default this process) and all its descendants now (Linux;
    0 where ``/proc`` is missing)."""
    root = os.getpid() if root is None else root
    parent: dict[int, int] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return 0
    for name in entries:
        if not name.isdigit():
            continue
        try:
            stat = Path(f"/proc/{name}/stat").read_text()
            # the command name may contain spaces and parentheses: ppid follows the last ')'
            parent[int(name)] = int(stat.rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
    tree, frontier = {root}, [root]
    while frontier:
        p = frontier.pop()
        for child, pp in parent.items():
            if pp == p and child not in tree:
                tree.add(child)
                frontier.append(child)
    return sum(_rss_of(pid) for pid in tree)


class RssGuard:
    def __init__(self, bound: int | None, interval_s: float = 1.0):
        self.bound = bound
        self.interval_s = interval_s
        self.tree_peak = tree_rss_bytes()
        self.failed_once = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, name=PLUGIN_NAME, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.tree_peak = max(self.tree_peak, tree_rss_bytes())

    def stop(self) -> None:
        self._stop.set()

    def figures(self) -> str:
        return (
            f"peak RSS: pytest process {self_peak_bytes() / GiB:.2f} GB, with its running "
            f"children {self.tree_peak / GiB:.2f} GB (sampled), largest finished child "
            f"{children_peak_bytes() / GiB:.2f} GB"
        )

    def over(self) -> str | None:
        if self.bound is None:
            return None
        self.tree_peak = max(self.tree_peak, tree_rss_bytes())
        worst = max(self_peak_bytes(), self.tree_peak, children_peak_bytes())
        if worst <= self.bound:
            return None
        return (
            f"{self.figures()}: past the bound of {self.bound / GiB:.2f} GB "
            "(CNA_TEST_MAX_RSS_GB). The suite must fit the CI machine: release models after "
            "the test (tests/host/conftest.py) or run it in a child process."
        )

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(self, item, call):
        outcome = yield
        if call.when != "teardown":
            return
        log = os.environ.get("CNA_TEST_RSS_LOG")
        if log:  # one line per test: where the memory goes
            with open(log, "a") as f:
                f.write(
                    f"{item.nodeid}\tnow {_rss_of(os.getpid()) / GiB:.2f} GB"
                    f"\tpeak {self_peak_bytes() / GiB:.2f} GB\n"
                )
        if self.failed_once:
            return
        msg = self.over()
        if msg is None:
            return
        self.failed_once = True
        rep = outcome.get_result()
        rep.outcome = "failed"
        rep.longrepr = f"memory bound exceeded after {item.nodeid}: {msg}"

    def pytest_sessionfinish(self, session, exitstatus):
        self.stop()
        if self.failed_once or self.over() is None:
            return
        self.failed_once = True  # grew past the bound outside any test (collection, teardown)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def pytest_terminal_summary(self, terminalreporter):
        bound = "off" if self.bound is None else f"{self.bound / GiB:.2f} GB"
        terminalreporter.write_line(f"{self.figures()}; bound {bound}")
        if self.failed_once:
            terminalreporter.write_line(
                "memory bound exceeded (CNA_TEST_MAX_RSS_GB): see the failed test above",
                red=True,
            )


def register(config) -> RssGuard | None:
    """Register the guard once per run (from any conftest's ``pytest_configure``)."""
    if config.pluginmanager.has_plugin(PLUGIN_NAME):
        return config.pluginmanager.get_plugin(PLUGIN_NAME)
    guard = RssGuard(bound_bytes())
    config.pluginmanager.register(guard, PLUGIN_NAME)
    return guard


def pytest_configure(config):
    """Also usable as a plugin module: ``-p`` or ``pytest_plugins``."""
    register(config)
