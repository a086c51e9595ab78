# SPDX-License-Identifier: GPL-3.0-or-later
"""ComfyUI-facing nodes: one ``nodes_<topic>.py`` per technique, kept thin."""
