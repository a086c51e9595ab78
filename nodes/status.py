# SPDX-License-Identifier: GPL-3.0-or-later
"""What our nodes did in the last sampling run, for the front end's badges (``web/js``).

Each technique calls ``report(node_id, kind, lines, data)`` when a run ends: ``lines`` are the
badge's text (short, human), ``data`` the figures. The payload goes to the browser that queued
the prompt through ComfyUI's own server messages (``PromptServer.send_sync``, event
``cna.status``; no polling) and is kept in ``LAST`` (node id → payload) for tests and headless
use. Without a running server (scripts, tests) only ``LAST`` is written. Never raises.
"""

from __future__ import annotations

import sys
import threading

from ..logger import logger

EVENT = "cna.status"
# Cache of the latest payload per node id, for tests and headless use: keyed by node id, at most
# LAST_KEEP nodes (the oldest report goes first).
LAST: dict[str, dict] = {}
LAST_KEEP = 256
_lock = threading.Lock()


def report(node_id, kind: str, lines: list[str], data: dict | None = None) -> None:
    if node_id is None:
        return
    payload = {"node": str(node_id), "kind": kind, "lines": list(lines), "data": data or {}}
    with _lock:
        LAST.pop(str(node_id), None)
        LAST[str(node_id)] = payload
        while len(LAST) > LAST_KEEP:
            del LAST[next(iter(LAST))]
    server = sys.modules.get("server")  # ComfyUI's server module, only when it is running
    inst = getattr(getattr(server, "PromptServer", None), "instance", None)
    if inst is None:
        return
    try:
        inst.send_sync(EVENT, payload, getattr(inst, "client_id", None))
    except Exception as e:  # a closed socket must never fail a run
        logger.debug("could not send %s for node %s: %s", EVENT, node_id, e)


def mib(x: float) -> str:
    """Bytes → '1.23 GB' / '456 MB' / '148 KB' (the badge's unit)."""
    if x >= 1024**3:
        return f"{x / 1024**3:.2f} GB"
    return f"{x / 1024**2:.0f} MB" if x >= 1024**2 else f"{x / 1024:.0f} KB"


def short(reason: str, n: int = 60) -> str:
    return reason if len(reason) <= n else reason[: n - 1] + "…"


def node_id_of(node_cls) -> str | None:
    """The running node's id (V3 hidden UNIQUE_ID), or None when called outside ComfyUI's
    executor (scripts and tests call ``execute`` directly)."""
    return getattr(getattr(node_cls, "hidden", None), "unique_id", None)
