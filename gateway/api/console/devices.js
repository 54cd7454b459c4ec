// Devices: presence, last seen, open alarms; a device's latest metrics and events, and a
// chart of one metric's recent values.
import { query } from "./api.js";
import { lineChart } from "./chart.js";
import { append, clear, el, number, throttle, timeEl, when } from "./util.js";

const PAGE = 100;
const CHART_SAMPLES = 100;

export class DevicesView {
  constructor(ctx) {
    this.ctx = ctx;
    this.form = document.getElementById("device-filters");
    this.body = document.querySelector("#device-table tbody");
    this.empty = document.getElementById("device-empty");
    this.more = document.getElementById("device-more");
    this.detail = document.getElementById("device-detail");
    this.items = [];
    this.next = null;
    this.selected = null;
    this.metric = null;
    this.refreshListSoon = throttle(() => this.load(false), 1000);
    this.form.addEventListener("submit", (event) => {
      event.preventDefault();
      this.load(false);
    });
    this.more.addEventListener("click", () => this.load(true));
  }

  async show(id) {
    await this.load(false);
    if (id) await this.open(id);
    else {
      this.selected = null;
      this.detail.hidden = true;
    }
  }

  async refresh() {
    await this.load(false);
    if (this.selected) await this.open(this.selected, { keepFocus: true });
  }

  async load(append) {
    const data = new FormData(this.form);
    const params = {
      presence: data.get("presence"),
      selector: data.get("selector").trim(),
      limit: PAGE,
      // The list is keyset paged; the cursor comes back as next_before (or next_after).
      before: append && this.cursorName === "before" ? this.next : null,
      after: append && this.cursorName === "after" ? this.next : null,
    };
    let page;
    try {
      page = await this.ctx.api.get(`/devices${query(params)}`);
    } catch (error) {
      this.ctx.notify(`Devices: ${error.message}`);
      return;
    }
    this.cursorName = "next_after" in page ? "after" : "before";
    this.next = page.next_after ?? page.next_before ?? null;
    this.items = append ? [...this.items, ...page.devices] : page.devices;
    this.render();
  }

  render() {
    clear(this.body);
    for (const device of this.items) {
      this.body.append(el("tr", { dataset: { deviceId: device.device_id }, class: device.device_id === this.selected ? "selected" : null },
        el("td", { "data-label": "Device" }, el("a", { href: `#/devices/${encodeURIComponent(device.device_id)}`, text: device.device_id })),
        el("td", { "data-label": "Presence" }, el("span", { class: `presence-${device.presence}`, text: device.presence })),
        el("td", { "data-label": "Last seen" }, timeEl(device.last_seen, true)),
        el("td", { "data-label": "Open alarms", class: "num" }, device.open_alarms > 0
          ? el("a", { href: `#/alarms?device=${encodeURIComponent(device.device_id)}`, text: String(device.open_alarms) })
          : "0")));
    }
    this.empty.hidden = this.items.length > 0;
    this.more.hidden = this.next === null;
  }

  // Maintenance: its new alarms are still raised and listed, their notifications suppressed.
  serviceControls(id, device) {
    if (!this.ctx.canAct()) return null;
    if (device.out_of_service) {
      return el("div", { class: "actions" }, el("button", {
        type: "button", text: "Back in service",
        onclick: () => this.service(id, () => this.ctx.api.delete(`/devices/${encodeURIComponent(id)}/out-of-service`)),
      }));
    }
    const reason = el("input", { id: `oos-reason-${id}`, type: "text", maxlength: "500", autocomplete: "off" });
    return el("div", { class: "shelve", role: "group", "aria-label": "Out of service" },
      el("label", { for: reason.id }, "Maintenance reason", reason),
      el("button", {
        type: "button", text: "Put out of service",
        onclick: () => reason.value.trim()
          ? this.service(id, () => this.ctx.api.put(`/devices/${encodeURIComponent(id)}/out-of-service`, { reason: reason.value.trim() }))
          : this.ctx.notify("Out of service needs a reason."),
      }));
  }

  async service(id, call) {
    try {
      await call();
      this.ctx.notify(`Device ${id}: done.`, "ok");
    } catch (error) {
      this.ctx.notify(`Device ${id}: ${error.message}`);
    }
    await this.open(id, { keepFocus: true });
  }

  async open(id, { keepFocus = false } = {}) {
    let answer;
    try {
      answer = await this.ctx.api.get(`/devices/${encodeURIComponent(id)}`);
    } catch (error) {
      this.ctx.notify(`Device ${id}: ${error.message}`);
      return;
    }
    const device = answer.device;
    if (this.selected !== id) this.metric = null;
    this.selected = id;
    this.render();
    const d = clear(this.detail);
    d.hidden = false;
    d.dataset.deviceId = id;
    const metrics = Object.entries(device.latest_metrics || {}).sort(([a], [b]) => a.localeCompare(b));
    if (this.metric === null && metrics.length) this.metric = metrics[0][0];
    append(d, 
      el("h3", { tabindex: "-1", text: device.device_id }),
      el("dl", {},
        el("dt", { text: "Presence" }), el("dd", {}, el("span", { class: `presence-${device.presence}`, text: device.presence })),
        el("dt", { text: "Last seen" }), el("dd", {}, timeEl(device.last_seen), " (", timeEl(device.last_seen, true), ")"),
        el("dt", { text: "First seen" }), el("dd", {}, timeEl(device.first_seen)),
        el("dt", { text: "Open alarms" }), el("dd", {}, el("a", { href: `#/alarms?device=${encodeURIComponent(id)}`, text: String(device.open_alarms) })),
        el("dt", { text: "Commands" }), el("dd", {}, device.bound === false ? "unbound " : "", el("a", { href: `#/commands/${encodeURIComponent(id)}`, text: "show commands" })),
        el("dt", { text: "Service" }), el("dd", { class: "out-of-service" }, device.out_of_service
          ? [`out of service since ${when(device.out_of_service.since)}`, device.out_of_service.until ? ` until ${when(device.out_of_service.until)}` : "", `: ${device.out_of_service.reason} (${device.out_of_service.set_by})`]
          : "in service")),
      el("div", { class: "actions" }, el("button", { type: "button", class: "secondary", text: "Refresh", onclick: () => this.open(id, { keepFocus: true }) })),
      this.serviceControls(id, device),
      el("h3", { text: "Latest metrics" }),
      metrics.length
        ? el("div", { class: "metrics" }, metrics.map(([name, sample]) => el("div", { class: "metric", dataset: { metric: name } },
          el("div", { class: "hint", text: name }),
          el("div", { class: "value", text: number(sample.value) }),
          el("div", { class: "hint" }, timeEl(sample.ts, true)),
          el("button", { type: "button", class: "secondary", "aria-pressed": String(name === this.metric), text: `Chart ${name}`, onclick: () => { this.metric = name; this.open(id, { keepFocus: true }); } }))))
        : el("p", { class: "hint", text: "No metrics received yet." }),
    );
    const chartBox = el("div", { class: "chart-box" });
    append(d, chartBox);
    const events = device.latest_events || [];
    append(d, el("h3", { text: "Latest events" }), events.length
      ? el("ol", { class: "audit" }, events.map((e) => el("li", {}, timeEl(e.ts), ` ${e.event}`)))
      : el("p", { class: "hint", text: "No events." }));
    if (this.metric) await this.chart(id, this.metric, chartBox);
    if (!keepFocus) d.querySelector("h3").focus();
  }

  async chart(id, metric, box) {
    let page;
    try {
      page = await this.ctx.api.get(`/devices/${encodeURIComponent(id)}/telemetry${query({ metric, limit: CHART_SAMPLES })}`);
    } catch (error) {
      box.append(el("p", { class: "error", text: `Chart: ${error.message}` }));
      return;
    }
    const points = page.samples
      .filter((s) => s.metrics && typeof s.metrics[metric] === "number")
      .map((s) => ({ t: new Date(s.ts), v: s.metrics[metric] }));
    box.append(el("h3", { text: `${metric}, last ${points.length} values` }), lineChart(points, { title: `${metric} of ${id}` }));
  }

  // Alarms change the open-alarm counts of the list; the open device is read on Refresh.
  onEvent(event) {
    if (event.aggregate_type === "alarm" && this.ctx.current() === "devices") this.refreshListSoon();
  }
}
