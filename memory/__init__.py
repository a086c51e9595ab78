# SPDX-License-Identifier: GPL-3.0-or-later
"""Memory techniques in plain PyTorch (no ComfyUI import): the quantized feature cache."""
