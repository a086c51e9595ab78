# SPDX-License-Identifier: GPL-3.0-or-later
"""The check of every combo input of the pack's nodes, in one place.

A combo value can reach a node three ways: as a widget value that ComfyUI validates (newer
versions check V3 combos against their options), as a widget value that it does not (0.3.x
passes V3 combo values through unchecked), and through a link (never checked by ComfyUI). Each
node therefore

- names its combos in ``validate_inputs`` (``widget_errors``): ComfyUI then leaves those
  inputs to the node on every version, so the prompt is refused at ``/prompt`` with the same
  message everywhere, before any node runs; linked values are not known yet and are skipped;
- checks them again first thing in ``execute`` (``check_choices``), which catches linked values
  and direct calls, with the same message raised as ``NodeInputError``.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Mapping

from ..errors import NodeInputError

# Lists longer than this (ComfyUI's samplers and schedulers) are not spelled out in full.
_LIST_ALL = 8


def choice_error(
    node: str, input_name: str, value: object, options: Iterable[str]
) -> NodeInputError | None:
    """The error for ``value`` on a combo input of ``options``, or None when it is one of them."""
    options = list(options)
    if isinstance(value, str) and value in options:
        return None
    if len(options) <= _LIST_ALL:
        fix = f"Choose one of {', '.join(map(repr, options))}."
    else:
        near = (
            difflib.get_close_matches(value, options, n=3, cutoff=0.5)
            if isinstance(value, str)
            else []
        )
        hint = f"Did you mean {' or '.join(map(repr, near))}? " if near else ""
        fix = f"{hint}Choose one of the {len(options)} entries of the node's list."
    return NodeInputError(node, input_name, f"is {value!r}, not one of its choices", fix)


def check_choices(node: str, choices: Mapping[str, tuple[object, Iterable[str]]]) -> None:
    """Raise ``NodeInputError`` for the first of ``{input: (value, options)}`` whose value is
    not one of its options."""
    for name, (value, options) in choices.items():
        err = choice_error(node, name, value, options)
        if err is not None:
            raise err


def widget_errors(node: str, choices: Mapping[str, tuple[object, Iterable[str]]]) -> str | None:
    """For ``validate_inputs``: the message of the first bad widget value, or None. ``None``
    values are links (ComfyUI passes them as None before they are computed) and are left to
    ``execute``."""
    for name, (value, options) in choices.items():
        if value is None:
            continue
        err = choice_error(node, name, value, options)
        if err is not None:
            return str(err)
    return None


def sampler_choices() -> tuple[list[str], list[str]]:
    """ComfyUI's samplers and schedulers as they are now (other packs may add some after the
    pack's schemas were built)."""
    import comfy.samplers

    return list(comfy.samplers.KSampler.SAMPLERS), list(comfy.samplers.KSampler.SCHEDULERS)
