// Devices: presence, last seen, open alarms; a device's latest metrics and events, a chart of
// one metric over a time range with its rules' threshold and clear lines, and a form to send
// the device a command. #/devices/<id>?metric=<m>&rule=<key> opens the chart on that metric
// (an alarm's), with that rule's lines.
import { query } from "./api.js";
import { lineChart } from "./chart.js";
import { sendCommand } from "./commands.js";
import { append, clear, el, now, number, readings, throttle, timeEl, when } from "./util.js";

const PAGE = 100;
const CHART_SAMPLES = 100;
// The chart's ranges: the newest values, or a window back from now (the API's page: 500).
const RANGES = [
  { key: "last", label: "Last 100 values", seconds: null },
  { key: "15m", label: "Last 15 minutes", seconds: 900 },
  { key: "1h", label: "Last hour", seconds: 3600 },
  { key: "6h", label: "Last 6 hours", seconds: 21600 },
  { key: "24h", label: "Last 24 hours", seconds: 86400 },
  { key: "7d", label: "Last 7 days", seconds: 604800 },
];
const RANGE_LIMIT = 500;
const LIMIT_MAX = 500; // the API's largest page
// While the list is shown it is read again this often: presence, "last seen" and its age
// ("just now" of a device since silent) stay true with nothing else happening.
const LIST_POLL_MS = 10000;

export class DevicesView {
  constructor(ctx) {
    this.ctx = ctx;
    this.reading = readings();
    this.detailReading = readings(); // the detail: only the device opened last is shown
    this.form = document.getElementById("device-filters");
    this.body = document.querySelector("#device-table tbody");
    this.empty = document.getElementById("device-empty");
    this.more = document.getElementById("device-more");
    this.detail = document.getElementById("device-detail");
    this.items = [];
    this.next = null;
    this.selected = null;
    this.metric = null;
    this.rule = null;
    this.range = "last";
    this.poll = null;
    this.appending = false; // "More devices" on its way: a live update waits for it
    this.refreshListSoon = throttle(() => (this.appending ? this.refreshListSoon() : this.reload()), 1000);
    this.refreshDetailSoon = throttle(() => this.selected === null ? null : this.open(this.selected, { keepFocus: true }), 1000);
    this.form.addEventListener("submit", (event) => {
      event.preventDefault();
      this.load(false);
    });
    this.more.addEventListener("click", () => this.load(true));
  }

  async show(id, params = {}) {
    await this.load(false);
    if (id && (params.metric || params.range)) {
      // A link to a metric (an alarm's): the chart opens on it, with its rule's lines.
      this.selected = id;
      this.metric = params.metric || null;
      this.rule = params.rule || null;
      if (RANGES.some((r) => r.key === params.range)) this.range = params.range;
    }
    if (id) await this.open(id);
    else this.close();
  }

  close() {
    this.detailReading(); // an answer on its way for the page closed is dropped
    this.selected = null;
    this.detail.hidden = true;
    clear(this.detail);
    this.render();
  }

  async refresh() {
    await this.load(false);
    if (this.selected) await this.open(this.selected, { keepFocus: true });
  }

  hide() {
    clearTimeout(this.poll);
    this.poll = null;
  }

  // The list read again from its start, as many devices as are shown (the pages "More
  // devices" loaded included): a live update used to read the first page alone, and the rows
  // loaded after it vanished under the operator.
  async reload() {
    const data = new FormData(this.form);
    const wanted = Math.max(PAGE, this.items.length);
    const current = this.reading();
    const items = [];
    let next = null;
    let cursorName = this.cursorName;
    try {
      let cursor = null;
      do {
        const page = await this.ctx.api.get(`/devices${query({
          presence: data.get("presence"),
          selector: data.get("selector").trim(),
          limit: Math.min(wanted - items.length, LIMIT_MAX),
          before: cursor !== null && cursorName === "before" ? cursor : null,
          after: cursor !== null && cursorName === "after" ? cursor : null,
        })}`);
        items.push(...page.items);
        cursorName = "next_after" in page ? "after" : "before";
        next = page.next_after ?? page.next_before ?? null;
        cursor = next;
      } while (next !== null && items.length < wanted);
    } catch (error) {
      if (current()) this.ctx.notify(`Devices: ${error.message}`);
      return;
    }
    if (!current()) return;
    this.cursorName = cursorName;
    this.next = next;
    this.items = items;
    this.render();
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
    const current = this.reading();
    if (append) this.appending = true;
    let page;
    try {
      page = await this.ctx.api.get(`/devices${query(params)}`);
    } catch (error) {
      if (current()) this.ctx.notify(`Devices: ${error.message}`);
      return;
    } finally {
      if (append) this.appending = false;
    }
    if (!current()) return;
    this.cursorName = "next_after" in page ? "after" : "before";
    this.next = page.next_after ?? page.next_before ?? null;
    this.items = append ? [...this.items, ...page.items] : page.items;
    this.render();
  }

  render() {
    // A link focused in the list (keyboard) stays focused across a reading of it.
    const focused = this.body.contains(document.activeElement) ? document.activeElement.getAttribute("href") : null;
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
    if (focused) {
      const again = [...this.body.querySelectorAll("a")].find((a) => a.getAttribute("href") === focused);
      if (again) again.focus({ preventScroll: true });
    }
    this.empty.hidden = this.items.length > 0;
    this.more.hidden = this.next === null;
    clearTimeout(this.poll);
    this.poll = null;
    if (this.ctx.current() === "devices") {
      this.poll = setTimeout(() => { if (this.ctx.current() === "devices") this.refreshListSoon(); }, LIST_POLL_MS);
    }
  }

  // Maintenance: its new alarms are still raised and listed, their notifications suppressed.
  // By the query, as the page's reads: a Sparkplug id's `/` cannot be in a path.
  serviceControls(id, device) {
    if (!this.ctx.canAct()) return null;
    if (device.out_of_service) {
      return el("div", { class: "actions" }, el("button", {
        type: "button", text: "Back in service",
        onclick: () => this.service(id, () => this.ctx.api.delete(`/device/out-of-service${query({ id })}`)),
      }));
    }
    const reason = el("input", { id: `oos-reason-${id}`, type: "text", maxlength: "500", autocomplete: "off" });
    return el("div", { class: "shelve", role: "group", "aria-label": "Out of service" },
      el("label", { for: reason.id }, "Maintenance reason", reason),
      el("button", {
        type: "button", text: "Put out of service",
        onclick: () => reason.value.trim()
          ? this.service(id, () => this.ctx.api.put(`/device/out-of-service${query({ id })}`, { reason: reason.value.trim() }))
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
    const current = this.detailReading();
    const other = this.selected !== id;
    // Selected at once: a refresh on its way reads this device, not the one shown before.
    this.selected = id;
    let answer;
    try {
      // By the query: a Sparkplug id's `/` cannot be in a path (`/devices/{id}` would split it).
      answer = await this.ctx.api.get(`/device${query({ id })}`);
    } catch (error) {
      if (!current()) return;
      // Another device's page must not stay under this one's selection (its forms act).
      if (this.detail.hidden || this.detail.dataset.deviceId !== id) this.close();
      this.ctx.notify(`Device ${id}: ${error.message}`);
      return;
    }
    if (!current()) return;
    const device = answer.device;
    if (other) {
      this.metric = null;
      this.rule = null;
    }
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
          el("button", { type: "button", class: "secondary", "aria-pressed": String(name === this.metric), text: `Chart ${name}`, onclick: () => { this.metric = name; this.rule = null; this.open(id, { keepFocus: true }); } }))))
        : el("p", { class: "hint", text: "No metrics received yet." }),
    );
    const chartBox = el("div", { class: "chart-box" });
    append(d, chartBox);
    if (this.ctx.canAct()) append(d, this.commandForm(id, device));
    const events = device.latest_events || [];
    append(d, el("h3", { text: "Latest events" }), events.length
      ? el("ol", { class: "audit" }, events.map((e) => el("li", {}, timeEl(e.ts), ` ${e.event}`)))
      : el("p", { class: "hint", text: "No events." }));
    if (this.metric) await this.chart(id, this.metric, chartBox);
    if (!keepFocus) d.querySelector("h3").focus();
  }

  async chart(id, metric, box) {
    const range = RANGES.find((r) => r.key === this.range) || RANGES[0];
    const params = range.seconds === null
      ? { metric, limit: CHART_SAMPLES }
      : { metric, limit: RANGE_LIMIT, since: new Date(now() - range.seconds * 1000).toISOString() };
    let page;
    let rules;
    try {
      [page, rules] = await Promise.all([
        this.ctx.api.get(`/device/telemetry${query({ id, ...params })}`),
        this.ctx.api.get(`/rules${query({ device: id, metric })}`),
      ]);
    } catch (error) {
      box.append(el("p", { class: "error", text: `Chart: ${error.message}` }));
      return;
    }
    const points = page.items
      .filter((s) => s.metrics && typeof s.metrics[metric] === "number")
      .map((s) => ({ t: new Date(s.ts), v: s.metrics[metric] }));
    // The rule the link named, or every threshold rule on this metric for this device.
    const chosen = rules.items.filter((r) => typeof r.value === "number" && (!this.rule || r.key === this.rule));
    const lines = [];
    for (const rule of chosen) {
      lines.push({ v: rule.value, kind: "trigger", label: `${rule.key}: fires ${rule.op} ${number(rule.value)}` });
      if (typeof rule.clear_value === "number" && rule.clear_value !== rule.value) {
        lines.push({ v: rule.clear_value, kind: "clear", label: `${rule.key}: clears at ${number(rule.clear_value)}` });
      }
    }
    const select = el("select", { name: "range", "aria-label": "Time range" },
      RANGES.map((r) => el("option", { value: r.key, selected: r.key === range.key, text: r.label })));
    select.addEventListener("change", () => {
      this.range = select.value;
      this.open(id, { keepFocus: true }).then(() => {
        const again = this.detail.querySelector(".chart-box select[name=range]");
        if (again) again.focus();
      });
    });
    const shown = range.seconds === null
      ? `last ${points.length} values`
      : `${points.length} values, ${range.label.toLowerCase()}${page.next_before ? ` (the newest ${RANGE_LIMIT})` : ""}`;
    box.append(
      el("div", { class: "chart-head" },
        el("h3", { text: `${metric}, ${shown}` }),
        el("label", {}, "Range", select)),
      lineChart(points, { title: `${metric} of ${id}`, lines }),
      lines.length
        ? el("p", { class: "hint chart-legend" }, lines.map((l) => el("span", { class: `legend-${l.kind}`, text: l.label })))
        : null,
      el("p", { class: "hint", text: "Point at the chart (or focus it and use the arrow keys) to read a value." }),
    );
  }

  // Sending this device a command, from its page (operators and admins).
  commandForm(id, device) {
    const name = el("input", { name: "name", type: "text", required: true, spellcheck: "false", autocomplete: "off" });
    const params = el("input", { name: "params", type: "text", value: "{}", spellcheck: "false", autocomplete: "off" });
    const delivery = el("select", { name: "delivery" },
      el("option", { value: "realtime", text: "realtime" }), el("option", { value: "deferrable", text: "deferrable" }));
    const result = el("p", { class: "command-result", role: "status" });
    const form = el("form", { class: "filters device-command" },
      el("fieldset", {},
        el("legend", { text: `Send ${id} a command` }),
        el("label", {}, "Command", name),
        el("label", {}, "Params (JSON object)", params),
        el("label", {}, "Delivery", delivery),
        el("button", { type: "submit", text: "Send command" })));
    form.addEventListener("submit", async (event) => {
      event.preventDefault();
      const answer = await sendCommand(this.ctx, id, { name: name.value, params: params.value, delivery: delivery.value }, params);
      if (!answer) return;
      clear(result);
      append(result, `Command ${answer.command.id} ${answer.created ? "sent" : "already existed"} (${answer.command.status}). `,
        el("a", { href: `#/commands/${encodeURIComponent(id)}`, text: "Follow it in Commands" }));
    });
    return el("section", { class: "device-commands", "aria-label": "Send a command" },
      el("h3", { text: "Send a command" }),
      device.bound === false ? el("p", { class: "hint", text: "This device is unbound: it takes no commands (the gateway refuses them)." }) : null,
      form, result);
  }

  // Alarms change the open-alarm counts of the list; a device put out of service or back
  // (by another operator) changes the list and, when it is the open one, its page.
  onEvent(event) {
    if (this.ctx.current() !== "devices") return;
    if (event.aggregate_type === "alarm") this.refreshListSoon();
    if (event.aggregate_type === "device") {
      this.refreshListSoon();
      if (this.selected !== null && String(event.aggregate_id) === String(this.selected)) this.refreshDetailSoon();
    }
  }
}
