// A small line chart of one metric's recent values, as inline SVG (no chart library).
const NS = "http://www.w3.org/2000/svg";

function svg(tag, attrs = {}, text) {
  const node = document.createElementNS(NS, tag);
  for (const [key, value] of Object.entries(attrs)) node.setAttribute(key, String(value));
  if (text !== undefined) node.textContent = text;
  return node;
}

// points: [{t: Date, v: number}], any order.
export function lineChart(points, { title, width = 600, height = 160 } = {}) {
  const sorted = [...points].filter((p) => Number.isFinite(p.v)).sort((a, b) => a.t - b.t);
  const root = svg("svg", { class: "chart", viewBox: `0 0 ${width} ${height}`, role: "img", "aria-label": title || "chart" });
  root.append(svg("title", {}, title || "chart"));
  if (sorted.length === 0) {
    root.append(svg("text", { x: 10, y: height / 2 }, "no values yet"));
    return root;
  }
  const pad = { left: 44, right: 10, top: 10, bottom: 20 };
  const t0 = sorted[0].t.getTime();
  const t1 = sorted[sorted.length - 1].t.getTime();
  let lo = Math.min(...sorted.map((p) => p.v));
  let hi = Math.max(...sorted.map((p) => p.v));
  if (lo === hi) { lo -= 1; hi += 1; }
  const x = (t) => pad.left + (t1 === t0 ? 0.5 : (t - t0) / (t1 - t0)) * (width - pad.left - pad.right);
  const y = (v) => pad.top + (1 - (v - lo) / (hi - lo)) * (height - pad.top - pad.bottom);
  root.append(svg("polyline", {
    points: sorted.map((p) => `${x(p.t.getTime()).toFixed(1)},${y(p.v).toFixed(1)}`).join(" "),
  }));
  root.append(svg("text", { x: 2, y: pad.top + 8 }, String(Number(hi.toFixed(2)))));
  root.append(svg("text", { x: 2, y: height - pad.bottom }, String(Number(lo.toFixed(2)))));
  const fmt = (t) => new Date(t).toLocaleTimeString();
  root.append(svg("text", { x: pad.left, y: height - 4 }, fmt(t0)));
  root.append(svg("text", { x: width - pad.right, y: height - 4, "text-anchor": "end" }, fmt(t1)));
  return root;
}
