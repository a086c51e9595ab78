// SPDX-License-Identifier: GPL-3.0-or-later
// ControlNet Accelerator: after each run, a compact badge under each of the pack's nodes with
// what it did — ms/step and speed-up (CUDA Graph), peak VRAM (Memory Pool, CUDA Graph), CUDA-graph
// status and fallback reason, feature-cache reuse, kernel backend. The server sends the figures
// with ComfyUI's own messages (event "cna.status", see nodes/status.py); nothing is polled.
// Setting "ControlNet Accelerator: show badges" turns them off.
import { app } from "../../../scripts/app.js";
import { api } from "../../../scripts/api.js";

const SETTING = "ControlNetAccelerator.ShowBadges";
const EVENT = "cna.status";
const COLORS = {
  cuda_graph: "#2e7d32",
  fused_apply: "#1565c0",
  feature_cache: "#6a1b9a",
  memory_pool: "#b45309",
};

// node id -> {kind, lines, data}; also readable by tests and other extensions
const badges = (window.cnaBadges = window.cnaBadges || {});

function showBadges() {
  try {
    const s = app.extensionManager?.setting;
    const v = s ? s.get(SETTING) : app.ui?.settings?.getSettingValue?.(SETTING);
    return v !== false;
  } catch {
    return true;
  }
}

function drawBadge(node, ctx) {
  const b = badges[String(node.id)];
  if (!b || !b.lines?.length || !showBadges()) return;
  const pad = 4;
  const lineH = 14;
  ctx.save();
  ctx.font = "11px sans-serif";
  const w = Math.max(...b.lines.map((l) => ctx.measureText(l).width)) + 2 * pad;
  const h = b.lines.length * lineH + 2 * pad - 2;
  const y = node.size[1] + 6;
  ctx.fillStyle = COLORS[b.kind] || "#444";
  ctx.globalAlpha = 0.9;
  ctx.beginPath();
  if (ctx.roundRect) ctx.roundRect(0, y, w, h, 4);
  else ctx.rect(0, y, w, h);
  ctx.fill();
  ctx.globalAlpha = 1;
  ctx.fillStyle = "#fff";
  ctx.textBaseline = "top";
  b.lines.forEach((l, i) => ctx.fillText(l, pad, y + pad + i * lineH));
  ctx.restore();
}

app.registerExtension({
  name: "ControlNetAccelerator.Badges",
  settings: [
    {
      id: SETTING,
      name: "Show speed, VRAM and graph-status badges on ControlNet Accelerator nodes",
      type: "boolean",
      defaultValue: true,
      category: ["ControlNet Accelerator", "Badges", "Show"],
    },
  ],
  setup() {
    api.addEventListener(EVENT, ({ detail }) => {
      if (!detail || detail.node == null) return;
      badges[String(detail.node)] = detail;
      app.graph?.setDirtyCanvas(true, false);
    });
  },
  beforeRegisterNodeDef(nodeType, nodeData) {
    if (!nodeData?.name?.startsWith("CNA_")) return;
    const orig = nodeType.prototype.onDrawForeground;
    nodeType.prototype.onDrawForeground = function (ctx, ...rest) {
      const r = orig?.apply(this, [ctx, ...rest]);
      drawBadge(this, ctx);
      return r;
    };
  },
});
