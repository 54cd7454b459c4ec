// Alarms: the open ones first, most severe first; filters; the detail with why it fired,
// its chain, its audit trail, its AI summary and the buttons GET /alarms/{id}/actions allows.
import { query } from "./api.js";
import { append, clear, el, throttle, timeEl, when } from "./util.js";

const SEVERITY_RANK = { CRITICAL: 4, MAJOR: 3, WARNING: 2, INFO: 1 };
const OPEN = new Set(["NEW", "PUSHED", "DELAYED", "CONFIRMED", "ESCALATED"]);
const PAGE = 200;
const ACTION_LABELS = { confirm: "Confirm", handle: "Mark handled", close: "Close", false: "False alarm" };

export function order(alarms) {
  return [...alarms].sort((a, b) =>
    Number(OPEN.has(b.status)) - Number(OPEN.has(a.status))
    || (SEVERITY_RANK[b.severity] || 0) - (SEVERITY_RANK[a.severity] || 0)
    || b.id - a.id);
}

export function severityBadge(severity) {
  return el("span", { class: `sev sev-${severity}`, text: severity });
}

function describeTrigger(trigger) {
  if (!trigger) return "—";
  if ("metric" in trigger) {
    return `${trigger.metric} = ${trigger.value} (rule: ${trigger.metric} ${trigger.op} ${trigger.threshold}) at ${when(trigger.sample_ts)}`;
  }
  if ("event" in trigger) return `event ${trigger.event} at ${when(trigger.sample_ts)}`;
  if ("silent_since" in trigger) return `silent since ${when(trigger.silent_since)}`;
  return JSON.stringify(trigger);
}

export class AlarmsView {
  constructor(ctx) {
    this.ctx = ctx;
    this.root = document.getElementById("view-alarms");
    this.form = document.getElementById("alarm-filters");
    this.body = document.querySelector("#alarm-table tbody");
    this.empty = document.getElementById("alarm-empty");
    this.more = document.getElementById("alarm-more");
    this.detail = document.getElementById("alarm-detail");
    this.items = [];
    this.nextBefore = null;
    this.selected = null;
    this.refreshListSoon = throttle(() => this.load(false), 300);
    this.refreshDetailSoon = throttle(() => this.selected === null ? null : this.open(this.selected, { keepFocus: true }), 300);
    this.form.addEventListener("submit", (event) => {
      event.preventDefault();
      this.refresh();
    });
    this.more.addEventListener("click", () => this.load(true));
  }

  filters() {
    const data = new FormData(this.form);
    return {
      status: data.get("status"),
      severity: data.get("severity"),
      device: data.get("device").trim(),
      rule: data.get("rule").trim(),
    };
  }

  setFilters(values) {
    for (const [name, value] of Object.entries(values)) {
      if (this.form.elements[name] && value !== undefined) this.form.elements[name].value = value;
    }
  }

  async show(id, params) {
    if (params && (params.device || params.rule)) {
      this.setFilters({ device: params.device || "", rule: params.rule || "", status: "" });
    }
    await this.load(false);
    if (id) await this.open(Number(id));
    else this.close();
  }

  async refresh() {
    await this.load(false);
    if (this.selected !== null) await this.open(this.selected, { keepFocus: true });
  }

  async load(append) {
    const f = this.filters();
    const params = {
      open: f.status === "open" ? "true" : null,
      status: f.status && f.status !== "open" ? f.status : null,
      device: f.device || null,
      rule: f.rule || null,
      limit: PAGE,
      before: append ? this.nextBefore : null,
    };
    let page;
    try {
      page = await this.ctx.api.get(`/alarms${query(params)}`);
    } catch (error) {
      this.ctx.notify(`Alarms: ${error.message}`);
      return;
    }
    this.items = append ? [...this.items, ...page.items] : page.items;
    this.nextBefore = page.next_before;
    this.render();
  }

  render() {
    const severity = this.filters().severity;
    // The API filters by status, device and rule; severity is filtered here, on the loaded pages.
    const shown = order(this.items.filter((a) => !severity || a.severity === severity));
    clear(this.body);
    for (const alarm of shown) {
      const link = el("a", { href: `#/alarms/${alarm.id}`, text: `#${alarm.id}` });
      const row = el("tr", { dataset: { alarmId: alarm.id }, class: alarm.id === this.selected ? "selected" : null },
        el("td", { "data-label": "Severity" }, severityBadge(alarm.severity)),
        el("td", { "data-label": "Alarm" }, link, alarm.rule_description ? el("div", { class: "hint", text: alarm.rule_description }) : null),
        el("td", { "data-label": "Device" }, el("a", { href: `#/devices/${encodeURIComponent(alarm.device_id)}`, text: alarm.device_id })),
        el("td", { "data-label": "Rule", text: alarm.rule_key }),
        el("td", { "data-label": "Status" }, el("span", { class: "status", text: alarm.status })),
        el("td", { "data-label": "Triggered" }, timeEl(alarm.triggered_at)));
      this.body.append(row);
    }
    this.empty.hidden = shown.length > 0;
    this.more.hidden = this.nextBefore === null || this.nextBefore === undefined;
  }

  close() {
    this.selected = null;
    this.detail.hidden = true;
    clear(this.detail);
    this.render();
  }

  async open(id, { keepFocus = false } = {}) {
    const api = this.ctx.api;
    let alarm, actions, chain, audit;
    try {
      [alarm, actions, chain, audit] = await Promise.all([
        api.get(`/alarms/${id}`), api.get(`/alarms/${id}/actions`),
        api.get(`/alarms/${id}/chain`), api.get(`/alarms/${id}/audit`),
      ]);
    } catch (error) {
      this.ctx.notify(`Alarm #${id}: ${error.message}`);
      return;
    }
    this.selected = id;
    this.render();
    this.renderDetail(alarm, actions, chain, audit);
    if (!keepFocus) this.detail.querySelector("h3").focus();
  }

  renderDetail(alarm, actions, chain, audit) {
    const d = this.detail;
    // Drawn again for the same alarm: keep the note being typed and the focused button.
    const same = d.dataset.alarmId === String(alarm.id) && !d.hidden;
    const note = same ? (d.querySelector(".actions input") || {}).value : "";
    const focused = same && d.contains(document.activeElement) ? document.activeElement.dataset.action : null;
    clear(d);
    d.hidden = false;
    d.dataset.alarmId = alarm.id;
    append(d, 
      el("h3", { tabindex: "-1" }, severityBadge(alarm.severity), ` Alarm #${alarm.id} `, el("span", { class: "status", id: "alarm-status", text: alarm.status })),
      el("dl", {},
        el("dt", { text: "Device" }), el("dd", {}, el("a", { href: `#/devices/${encodeURIComponent(alarm.device_id)}`, text: alarm.device_id })),
        el("dt", { text: "Rule" }), el("dd", { text: alarm.rule_key }),
        el("dt", { text: "Why" }), el("dd", { class: "trigger", text: describeTrigger(alarm.trigger) }),
        el("dt", { text: "Rule says" }), el("dd", { class: "rule-description", text: alarm.rule_description || "—" }),
        el("dt", { text: "Triggered" }), el("dd", {}, timeEl(alarm.triggered_at)),
        alarm.cleared_at ? [el("dt", { text: "Cleared" }), el("dd", {}, timeEl(alarm.cleared_at))] : null,
        alarm.superseded_by ? [el("dt", { text: "Superseded by" }), el("dd", {}, el("a", { href: `#/alarms/${alarm.superseded_by}`, text: `#${alarm.superseded_by}` }))] : null),
    );
    append(d, this.renderActions(alarm, actions));
    if (note) { const input = d.querySelector(".actions input"); if (input) input.value = note; }
    if (focused) { const button = d.querySelector(`.actions button[data-action="${focused}"]`); if (button) button.focus(); }
    append(d, el("h3", { text: "AI summary" }), this.renderSummary(alarm.ai_summary));
    append(d, el("h3", { text: "Chain" }), el("ol", { class: "chain" },
      chain.items.map((a) => el("li", {}, a.id === alarm.id ? el("strong", { text: `#${a.id}` }) : el("a", { href: `#/alarms/${a.id}`, text: `#${a.id}` }), ` ${a.status}, ${when(a.triggered_at)}`))),
      chain.hint ? el("p", { class: "hint", text: chain.hint }) : null);
    append(d, el("h3", { text: "Audit trail" }), el("ol", { class: "audit" },
      audit.items.map((entry) => el("li", {},
        timeEl(entry.at), " ", el("strong", { class: "actor", text: entry.actor }), ` ${entry.action}: ${entry.from_status || "—"} → ${entry.to_status}`,
        entry.stated_actor ? el("span", { class: "hint", text: ` (said to be ${entry.stated_actor})` }) : null,
        entry.note ? el("div", { class: "hint", text: `“${entry.note}”` }) : null))));
  }

  renderActions(alarm, actions) {
    const box = el("div", { class: "actions", role: "group", "aria-label": "Actions" });
    if (!this.ctx.canAct() || actions.actions.length === 0) {
      if (actions.superseded_by) box.append(el("p", { class: "hint", text: `Handled through #${actions.superseded_by}.` }));
      return box;
    }
    const noteId = `note-${alarm.id}`;
    const note = el("input", { id: noteId, type: "text", maxlength: "2000", autocomplete: "off" });
    box.append(el("label", { for: noteId }, "Note (optional)", note));
    for (const action of actions.actions) {
      box.append(el("button", {
        type: "button", dataset: { action },
        text: ACTION_LABELS[action] || action,
        onclick: (event) => this.act(alarm.id, action, note.value, event.currentTarget),
      }));
    }
    return box;
  }

  renderSummary(summary) {
    if (!summary) return el("p", { class: "hint", text: "No AI summary for this alarm." });
    if (summary.status !== "SUCCEEDED") {
      return el("p", { class: "hint", text: `Summary ${summary.status.toLowerCase()}${summary.error_code ? ` (${summary.error_code})` : ""}, attempt ${summary.attempt}.` });
    }
    return el("dl", { class: "summary" },
      el("dt", { text: "Summary" }), el("dd", { text: summary.summary || "—" }),
      el("dt", { text: "Possible cause" }), el("dd", { text: summary.possible_cause || "—" }),
      el("dt", { text: "Inspect" }), el("dd", { text: summary.inspection_suggestion || "—" }),
      el("dt", { text: "Risk" }), el("dd", { text: `${summary.risk_level || "—"} (confidence ${summary.confidence ?? "—"}, ${summary.model_name})` }));
  }

  async act(id, action, note, button) {
    for (const b of this.detail.querySelectorAll(".actions button")) b.disabled = true;
    const body = note.trim() ? { note: note.trim() } : {};
    try {
      await this.ctx.api.post(`/alarms/${id}/${action}`, body);
      this.ctx.notify(`Alarm #${id}: ${action} done.`, "ok");
    } catch (error) {
      this.ctx.notify(await this.refusal(id, action, error));
    }
    await this.load(false);
    await this.open(id, { keepFocus: true });
    const again = this.detail.querySelector(`.actions button[data-action="${action}"]`) || this.detail.querySelector(".actions button") || this.detail.querySelector("h3");
    if (button) again.focus();
  }

  // A race lost (409), or a button that went stale (someone acted since the page drew it):
  // say who did it, from the answer or from the audit trail.
  async refusal(id, action, error) {
    if (error.status === 409 && error.body.actor) {
      return `${error.body.actor} already did this (the alarm is ${error.body.current_status || "changed"}).`;
    }
    if (error.code === "ILLEGAL_TRANSITION" || error.status === 409) {
      try {
        const audit = await this.ctx.api.get(`/alarms/${id}/audit`);
        const last = audit.items[audit.items.length - 1];
        if (last) return `${last.actor} acted first (${last.action}): the alarm is now ${last.to_status}.`;
      } catch { /* fall through to the API's own words */ }
    }
    return `Could not ${action} alarm #${id}: ${error.message}`;
  }

  onEvent(event) {
    if (event.aggregate_type !== "alarm" || this.ctx.current() !== "alarms") return;
    this.refreshListSoon();
    // The detail is drawn again only for its own alarm: a note being typed is kept.
    if (this.selected !== null && String(event.aggregate_id) === String(this.selected)) this.refreshDetailSoon();
  }
}
