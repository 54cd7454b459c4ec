// Figures: the alarm system's own figures (GET /alarm-stats; EEMUA 191, ISA-18.2): alarms per
// 10 minutes against the target and the flood threshold, flood periods, chattering pairs,
// stale alarms, the top rules and devices, operators and the time to acknowledge.
import { query } from "./api.js";
import { clear, el, readings, throttle, timeEl, when } from "./util.js";

const NS = "http://www.w3.org/2000/svg";

function svg(tag, attrs = {}, text) {
  const node = document.createElementNS(NS, tag);
  for (const [key, value] of Object.entries(attrs)) node.setAttribute(key, String(value));
  if (text !== undefined) node.textContent = text;
  return node;
}

export function seconds(value) {
  if (value === null || value === undefined) return "—";
  if (value < 90) return `${Math.round(value)} s`;
  if (value < 5400) return `${(value / 60).toFixed(1)} min`;
  if (value < 172800) return `${(value / 3600).toFixed(1)} h`;
  return `${(value / 86400).toFixed(1)} days`;
}

function percent(share) {
  return `${(share * 100).toFixed(share > 0 && share < 0.01 ? 2 : 1)} %`;
}

// One bar per 10-minute interval; bars over the flood threshold in the flood colour, a line at
// the threshold.
function intervalChart(series, flood) {
  const width = 1000;
  const height = 170;
  const pad = { left: 36, right: 8, top: 10, bottom: 20 };
  const peak = Math.max(flood + 1, ...series.map((b) => b.alarms));
  const root = svg("svg", { class: "chart bars", viewBox: `0 0 ${width} ${height}`, role: "img",
    "aria-label": `Alarms per 10 minutes, ${series.length} intervals, peak ${Math.max(0, ...series.map((b) => b.alarms))}` });
  root.append(svg("title", {}, "Alarms per 10 minutes"));
  const plotW = width - pad.left - pad.right;
  const plotH = height - pad.top - pad.bottom;
  const step = plotW / Math.max(1, series.length);
  const y = (v) => pad.top + (1 - v / peak) * plotH;
  series.forEach((bucket, index) => {
    if (!bucket.alarms) return;
    const bar = svg("rect", {
      x: (pad.left + index * step).toFixed(2), y: y(bucket.alarms).toFixed(2),
      width: Math.max(1, step - 1).toFixed(2), height: (plotH - (y(bucket.alarms) - pad.top)).toFixed(2),
      class: bucket.alarms > flood ? "flood" : "",
    });
    bar.append(svg("title", {}, `${when(bucket.starts_at)}: ${bucket.alarms}`));
    root.append(bar);
  });
  root.append(svg("line", { x1: pad.left, x2: width - pad.right, y1: y(flood), y2: y(flood), class: "threshold" }));
  root.append(svg("text", { x: 2, y: y(flood) + 4 }, String(flood)));
  root.append(svg("text", { x: 2, y: pad.top + 8 }, String(peak)));
  if (series.length) {
    root.append(svg("text", { x: pad.left, y: height - 4 }, when(series[0].starts_at)));
    root.append(svg("text", { x: width - pad.right, y: height - 4, "text-anchor": "end" }, when(series[series.length - 1].starts_at)));
  }
  return root;
}

function tile(name, label, value, { bad = false, hint = null } = {}) {
  return el("div", { class: bad ? "metric bad" : "metric", dataset: { figure: name } },
    el("div", { class: "hint", text: label }),
    el("div", { class: "value", text: value }),
    hint ? el("div", { class: "hint", text: hint }) : null);
}

function table(caption, headers, rows, empty) {
  if (!rows.length) return el("p", { class: "empty", text: empty });
  return el("table", { class: "grid" },
    el("caption", { class: "sr-only", text: caption }),
    el("thead", {}, el("tr", {}, headers.map((h) => el("th", { scope: "col", text: h })))),
    el("tbody", {}, rows));
}

export class StatsView {
  constructor(ctx) {
    this.ctx = ctx;
    this.reading = readings();
    this.form = document.getElementById("figure-filters");
    this.root = document.getElementById("figures");
    this.stats = null;
    this.refreshSoon = throttle(() => this.load(), 5000);
    this.form.addEventListener("submit", (event) => {
      event.preventDefault();
      this.load();
    });
    this.form.elements.window.addEventListener("change", () => this.load());
  }

  show(_id, params = {}) {
    if (params.window) this.form.elements.window.value = params.window;
    return this.load();
  }

  refresh() { return this.load(); }

  async load() {
    const span = this.form.elements.window.value;
    const current = this.reading();
    let stats;
    try {
      stats = await this.ctx.api.get(`/alarm-stats${query({ window: span })}`);
    } catch (error) {
      if (current()) this.ctx.notify(`Figures: ${error.message}`);
      return;
    }
    if (!current()) return;
    this.stats = stats;
    this.render();
  }

  render() {
    const s = this.stats;
    const t = s.thresholds;
    const ack = s.acknowledgement;
    clear(this.root);
    this.root.append(
      el("p", { class: "hint" }, "From ", timeEl(s.since), " to ", timeEl(s.until),
        `: flood above ${t.flood_alarms} alarms in 10 minutes, chattering at ${t.chatter_raises} raises within ${t.chatter_window_s} s, stale after ${seconds(t.stale_after_s)}, target ${t.target_per_10min} per 10 minutes.`),
      el("div", { class: "metrics" },
        tile("alarms", "Alarms", String(s.alarms)),
        tile("average", "Average per 10 min", String(s.per_10min.average),
          { bad: s.per_10min.average > t.target_per_10min, hint: `target ${t.target_per_10min}` }),
        tile("peak", "Peak per 10 min", String(s.per_10min.peak), { bad: s.per_10min.peak > t.flood_alarms }),
        tile("floods", "Flood periods", String(s.floods.periods.length),
          { bad: s.floods.periods.length > 0, hint: `${percent(s.floods.share)} of the time` }),
        tile("chattering", "Chattering pairs", String(s.chattering.count), { bad: s.chattering.count > 0 }),
        tile("stale", "Stale alarms", String(s.stale.count), { bad: s.stale.count > 0 }),
        tile("ack-median", "Time to acknowledge (median)", seconds(ack.median_s), { hint: `${ack.acknowledged} acknowledged` }),
        tile("ack-p90", "Time to acknowledge (90th pct.)", seconds(ack.p90_s), { hint: `longest ${seconds(ack.max_s)}` })),
      el("h3", { text: "Alarms per 10 minutes" }),
      intervalChart(s.per_10min.series, t.flood_alarms),
      el("h3", { text: "Flood periods" }),
      table("Flood periods", ["Starts", "Ends", "Intervals", "Alarms", "Peak"],
        s.floods.periods.map((p) => el("tr", {},
          el("td", { "data-label": "Starts" }, timeEl(p.starts_at)),
          el("td", { "data-label": "Ends" }, timeEl(p.ends_at)),
          el("td", { "data-label": "Intervals", class: "num", text: String(p.intervals) }),
          el("td", { "data-label": "Alarms", class: "num", text: String(p.alarms) }),
          el("td", { "data-label": "Peak", class: "num", text: String(p.peak) }))),
        "No flood in this window."),
      el("h3", { text: "Chattering" }),
      table("Chattering rule and device pairs", ["Rule", "Device", "Alarms", `Most within ${t.chatter_window_s} s`, "Since"],
        s.chattering.items.map((c) => el("tr", { dataset: { chatter: `${c.rule_key}/${c.device_id}` } },
          el("td", { "data-label": "Rule" }, el("a", { href: `#/alarms?rule=${encodeURIComponent(c.rule_key)}&device=${encodeURIComponent(c.device_id)}`, text: c.rule_key })),
          el("td", { "data-label": "Device" }, el("a", { href: `#/devices/${encodeURIComponent(c.device_id)}`, text: c.device_id })),
          el("td", { "data-label": "Alarms", class: "num", text: String(c.alarms) }),
          el("td", { "data-label": "Most", class: "num", text: String(c.peak) }),
          el("td", { "data-label": "Since" }, timeEl(c.since)))),
        "Nothing chattered in this window."),
      el("h3", { text: "Stale alarms" }),
      table("Stale alarms, oldest first", ["Alarm", "Device", "Rule", "Status", "Open for"],
        s.stale.oldest.map((a) => el("tr", { dataset: { alarmId: a.id } },
          el("td", { "data-label": "Alarm" }, el("a", { href: `#/alarms/${a.id}`, text: `#${a.id}` })),
          el("td", { "data-label": "Device", text: a.device_id }),
          el("td", { "data-label": "Rule", text: a.rule_key }),
          el("td", { "data-label": "Status", class: "status", text: a.status }),
          el("td", { "data-label": "Open for", text: seconds(a.open_s) }))),
        "No alarm has been open that long."),
      el("div", { class: "split even" },
        el("div", {},
          el("h3", { text: "Top rules" }),
          this.top("Top rules", s.top_rules, (key) => `#/alarms?rule=${encodeURIComponent(key)}`, "top-rules")),
        el("div", {},
          el("h3", { text: "Top devices" }),
          this.top("Top devices", s.top_devices, (key) => `#/devices/${encodeURIComponent(key)}`, "top-devices"))),
      el("h3", { text: "Operators" }),
      table("People's actions per operator", ["Operator", "Actions", "Alarms", "Per 10 min", "Peak per 10 min", "Acknowledged", "Ack median", "Ack 90th pct."],
        s.operators.map((o) => el("tr", { dataset: { actor: o.actor } },
          el("td", { "data-label": "Operator", text: o.actor }),
          el("td", { "data-label": "Actions", class: "num", text: String(o.actions) }),
          el("td", { "data-label": "Alarms", class: "num", text: String(o.alarms) }),
          el("td", { "data-label": "Per 10 min", class: "num", text: String(o.per_10min) }),
          el("td", { "data-label": "Peak per 10 min", class: "num", text: String(o.peak_10min) }),
          el("td", { "data-label": "Acknowledged", class: "num", text: String(o.acknowledged) }),
          el("td", { "data-label": "Ack median", text: seconds(o.ack_median_s) }),
          el("td", { "data-label": "Ack 90th pct.", text: seconds(o.ack_p90_s) }))),
        "Nobody acted on an alarm in this window."),
    );
  }

  top(caption, items, href, name) {
    return table(caption, ["", "Alarms", "Share"],
      items.map((item) => el("tr", { dataset: { [name === "top-rules" ? "rule" : "device"]: item.key } },
        el("td", {}, el("a", { href: href(item.key), text: item.key })),
        el("td", { "data-label": "Alarms", class: "num", text: String(item.alarms) }),
        el("td", { "data-label": "Share", class: "num", text: percent(item.share) }))),
      "No alarms in this window.");
  }

  onEvent(event) {
    if (event.aggregate_type === "alarm" && this.ctx.current() === "figures") this.refreshSoon();
  }
}
