// A line chart of one metric's values, as inline SVG (no chart library): horizontal lines for
// the rules' thresholds (where an alarm fires, dashed where it clears), and, under the pointer
// (or the keyboard's arrows), the nearest value with its time.
import { clock, number, when } from "./util.js";

const NS = "http://www.w3.org/2000/svg";

function svg(tag, attrs = {}, text) {
  const node = document.createElementNS(NS, tag);
  for (const [key, value] of Object.entries(attrs)) node.setAttribute(key, String(value));
  if (text !== undefined) node.textContent = text;
  return node;
}

// points: [{t: Date, v: number}], any order. lines: [{v: number, label: string, kind:
// "trigger" | "clear"}], drawn across the chart and kept inside its value range.
export function lineChart(points, { title, lines = [], width = 600, height = 200 } = {}) {
  const sorted = [...points].filter((p) => Number.isFinite(p.v)).sort((a, b) => a.t - b.t);
  const root = svg("svg", { class: "chart", viewBox: `0 0 ${width} ${height}`, role: "img", "aria-label": title || "chart" });
  root.append(svg("title", {}, title || "chart"));
  if (sorted.length === 0) {
    root.append(svg("text", { x: 10, y: height / 2 }, "no values in this range"));
    return root;
  }
  const drawn = lines.filter((l) => Number.isFinite(l.v));
  const pad = { left: 48, right: 10, top: 12, bottom: 22 };
  const t0 = sorted[0].t.getTime();
  const t1 = sorted[sorted.length - 1].t.getTime();
  const values = [...sorted.map((p) => p.v), ...drawn.map((l) => l.v)];
  let lo = Math.min(...values);
  let hi = Math.max(...values);
  if (lo === hi) { lo -= 1; hi += 1; }
  const margin = (hi - lo) * 0.05;
  lo -= margin; hi += margin;
  const x = (t) => pad.left + (t1 === t0 ? 0.5 : (t - t0) / (t1 - t0)) * (width - pad.left - pad.right);
  const y = (v) => pad.top + (1 - (v - lo) / (hi - lo)) * (height - pad.top - pad.bottom);
  for (const line of drawn) {
    const at = y(line.v).toFixed(1);
    const group = svg("g", { class: `rule-line rule-${line.kind}`, "data-value": line.v });
    group.append(svg("line", { x1: pad.left, x2: width - pad.right, y1: at, y2: at }));
    group.append(svg("text", { x: width - pad.right - 2, y: Number(at) - 3, "text-anchor": "end" }, line.label));
    root.append(group);
  }
  root.append(svg("polyline", {
    points: sorted.map((p) => `${x(p.t.getTime()).toFixed(1)},${y(p.v).toFixed(1)}`).join(" "),
  }));
  const axisValue = (v) => String(Number(v.toPrecision(4)));
  root.append(svg("text", { x: 2, y: pad.top + 8 }, axisValue(hi)));
  root.append(svg("text", { x: 2, y: height - pad.bottom }, axisValue(lo)));
  const sameDay = new Date(t0).toDateString() === new Date(t1).toDateString();
  const axis = (t) => (sameDay ? clock(t) : when(t));
  root.append(svg("text", { x: pad.left, y: height - 5 }, axis(t0)));
  root.append(svg("text", { x: width - pad.right, y: height - 5, "text-anchor": "end" }, axis(t1)));

  // The value under the pointer: a marker on the nearest point and its value and time.
  const marker = svg("circle", { class: "marker", r: 4, cx: -10, cy: -10, visibility: "hidden" });
  const readout = svg("text", { class: "readout", x: pad.left + 4, y: pad.top + 10 }, "");
  root.append(marker, readout);
  let shown = -1;
  const show = (index) => {
    shown = Math.max(0, Math.min(sorted.length - 1, index));
    const p = sorted[shown];
    marker.setAttribute("cx", x(p.t.getTime()).toFixed(1));
    marker.setAttribute("cy", y(p.v).toFixed(1));
    marker.setAttribute("visibility", "visible");
    readout.textContent = `${number(p.v)} at ${when(p.t)}`;
    root.dataset.hoverValue = String(p.v);
  };
  const hide = () => {
    shown = -1;
    marker.setAttribute("visibility", "hidden");
    readout.textContent = "";
    delete root.dataset.hoverValue;
  };
  root.addEventListener("pointermove", (event) => {
    const box = root.getBoundingClientRect();
    if (box.width === 0) return;
    const at = ((event.clientX - box.left) / box.width) * width;
    let best = 0;
    for (let i = 1; i < sorted.length; i += 1) {
      if (Math.abs(x(sorted[i].t.getTime()) - at) < Math.abs(x(sorted[best].t.getTime()) - at)) best = i;
    }
    show(best);
  });
  root.addEventListener("pointerleave", hide);
  // The keyboard reaches the same values: focus the chart, then the arrows.
  root.setAttribute("tabindex", "0");
  root.addEventListener("keydown", (event) => {
    if (event.key === "ArrowLeft") show(shown < 0 ? sorted.length - 1 : shown - 1);
    else if (event.key === "ArrowRight") show(shown < 0 ? 0 : shown + 1);
    else if (event.key === "Escape") hide();
    else return;
    event.preventDefault();
  });
  root.addEventListener("blur", hide);
  return root;
}
