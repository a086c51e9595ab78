# SPDX-License-Identifier: GPL-3.0-or-later
"""The pack's one named logger. Every module logs through ``logger``; nothing prints."""

from __future__ import annotations

import logging

logger = logging.getLogger("ControlNetAccelerator")
