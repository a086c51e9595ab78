# SPDX-License-Identifier: GPL-3.0-or-later
"""The pack's exceptions. A user-facing error names the node, the input and the fix."""

from __future__ import annotations


class ControlNetAcceleratorError(RuntimeError):
    """Root of every error the pack raises on purpose."""


class NodeInputError(ControlNetAcceleratorError, ValueError):
    """A node got an input it cannot use; the message says which and what to do."""

    def __init__(self, node: str, input_name: str, problem: str, fix: str):
        self.node, self.input_name, self.problem, self.fix = node, input_name, problem, fix
        super().__init__(f"{node}: input '{input_name}' {problem}. {fix}")
