# SPDX-License-Identifier: GPL-3.0-or-later
"""Convert between ComfyUI's API prompt format and its UI (front-end graph) format.

``example_workflows/`` must hold UI-format graphs (what the front end's template browser
loads); tests need API prompts to execute them. Both directions read the node definitions from
the running ComfyUI (``INPUT_TYPES``, ``RETURN_TYPES``), so a converted graph is checked against
the real nodes: widget order, link types, seeds' ``control_after_generate`` slot.
"""

from __future__ import annotations

WIDGET_TYPES = {"INT", "FLOAT", "STRING", "BOOLEAN", "COMBO"}


def _node_class(class_type: str):
    import nodes

    cls = nodes.NODE_CLASS_MAPPINGS.get(class_type)
    if cls is None:
        raise KeyError(f"unknown node type {class_type!r} (is the pack loaded?)")
    return cls


def input_specs(class_type: str) -> list[tuple[str, str, dict]]:
    """(name, type, options) of every input in the order the front end lays out widgets."""
    it = _node_class(class_type).INPUT_TYPES()
    out = []
    for section in ("required", "optional"):
        for name, spec in (it.get(section) or {}).items():
            typ = spec[0]
            opts = spec[1] if len(spec) > 1 and isinstance(spec[1], dict) else {}
            if isinstance(typ, (list, tuple)):
                typ = "COMBO"
            out.append((name, str(typ), opts))
    return out


def output_specs(class_type: str) -> list[tuple[str, str]]:
    cls = _node_class(class_type)
    types = list(cls.RETURN_TYPES)
    names = list(getattr(cls, "RETURN_NAMES", None) or types)
    return [(n, str(t)) for n, t in zip(names, types, strict=True)]


def _is_link(v) -> bool:
    return isinstance(v, list) and len(v) == 2 and isinstance(v[0], str) and isinstance(v[1], int)


# Rough LiteGraph geometry, so nodes (and the badges drawn under ours) do not overlap.
_TALL = {"LoadImage": 330, "CLIPTextEncode": 150, "SaveImage": 300, "PreviewImage": 300}


def _layout(nodes: dict, depth: dict) -> None:
    """Columns by dependency depth; in each column nodes stacked by their estimated height,
    with room below each for the pack's run badge."""
    y: dict[int, int] = {}
    for nid in sorted(nodes, key=int):
        n = nodes[nid]
        slots = max(len(n["inputs"]), len(n["outputs"]))
        widgets = len(n["widgets_values"])
        h = 40 + 22 * slots + 24 * widgets + _TALL.get(n["type"], 0)
        col = depth[nid]
        n["pos"] = [40 + 420 * col, y.get(col, 40)]
        n["size"] = [360, h]
        y[col] = y.get(col, 40) + h + 110


def api_to_ui(prompt: dict, titles: dict[str, str] | None = None) -> dict:
    """A UI-format graph for an API prompt, laid out left to right by dependency depth."""
    titles = titles or {}
    depth: dict[str, int] = {}

    def d(nid: str) -> int:
        if nid not in depth:
            ins = [v[0] for v in prompt[nid]["inputs"].values() if _is_link(v)]
            depth[nid] = 1 + max((d(s) for s in ins), default=-1)
        return depth[nid]

    for nid in prompt:
        d(nid)
    rows: dict[int, int] = {}
    links, nodes_out = [], {}
    for nid in sorted(prompt, key=int):
        ct = prompt[nid]["class_type"]
        col = depth[nid]
        row = rows.get(col, 0)
        rows[col] = row + 1
        node = {
            "id": int(nid),
            "type": ct,
            "pos": [40 + 360 * col, 40 + 260 * row],
            "size": [320, 200],
            "flags": {},
            "order": 0,
            "mode": 0,
            "inputs": [],
            "outputs": [
                {"name": n, "type": t, "links": [], "slot_index": i}
                for i, (n, t) in enumerate(output_specs(ct))
            ],
            "properties": {"Node name for S&R": ct},
            "widgets_values": [],
        }
        if nid in titles:
            node["title"] = titles[nid]
        nodes_out[nid] = node
    for nid in sorted(prompt, key=int):
        ct = prompt[nid]["class_type"]
        node = nodes_out[nid]
        given = prompt[nid]["inputs"]
        for name, typ, opts in input_specs(ct):
            v = given.get(name)
            if _is_link(v):
                src, slot = v
                link_id = len(links) + 1
                links.append(
                    [
                        link_id,
                        int(src),
                        slot,
                        int(nid),
                        len(node["inputs"]),
                        output_specs(prompt[src]["class_type"])[slot][1],
                    ]
                )
                node["inputs"].append({"name": name, "type": typ, "link": link_id})
                nodes_out[src]["outputs"][slot]["links"].append(link_id)
            elif typ in WIDGET_TYPES:
                if v is None:
                    v = opts.get("default")
                node["widgets_values"].append(v)
                if opts.get("control_after_generate"):
                    node["widgets_values"].append("fixed")
                if opts.get("image_upload"):
                    node["widgets_values"].append("image")
            elif name in given:
                raise ValueError(f"{ct}.{name}: {v!r} is neither a link nor a widget value")
    order = sorted(prompt, key=lambda n: (depth[n], int(n)))
    for i, nid in enumerate(order):
        nodes_out[nid]["order"] = i
    _layout(nodes_out, depth)
    return {
        "last_node_id": max(int(n) for n in prompt),
        "last_link_id": len(links),
        "nodes": [nodes_out[n] for n in sorted(prompt, key=int)],
        "links": links,
        "groups": [],
        "config": {},
        "extra": {},
        "version": 0.4,
    }


def ui_to_api(ui: dict) -> dict:
    """The API prompt a UI graph stands for (what the front end would queue)."""
    by_link = {lk[0]: lk for lk in ui["links"]}
    prompt = {}
    for node in ui["nodes"]:
        if node.get("mode", 0) != 0:
            continue
        ct = node["type"]
        inputs: dict = {}
        linked = {i["name"]: i.get("link") for i in node.get("inputs", [])}
        values = list(node.get("widgets_values", []))
        for name, typ, opts in input_specs(ct):
            if linked.get(name) is not None:
                lk = by_link[linked[name]]
                inputs[name] = [str(lk[1]), lk[2]]
            elif typ in WIDGET_TYPES and name not in linked:
                if not values:
                    # A widget the node gained after the graph was saved: the front end gives
                    # it its default (an old workflow keeps loading).
                    if "default" in opts:
                        inputs[name] = opts["default"]
                        continue
                    raise ValueError(f"node {node['id']} ({ct}): no widget value for {name!r}")
                inputs[name] = values.pop(0)
                if opts.get("control_after_generate") or opts.get("image_upload"):
                    values.pop(0)
        if values:
            raise ValueError(f"node {node['id']} ({ct}): {len(values)} widget values left over")
        prompt[str(node["id"])] = {"class_type": ct, "inputs": inputs}
    return prompt
