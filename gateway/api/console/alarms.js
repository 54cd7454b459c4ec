// Alarms: the desk. A header always in sight counts the open alarms per severity and state;
// the list separates active alarms from those returned to normal (unacknowledged first); it
// groups by rule or device; checkboxes feed bulk actions (one result per alarm); the detail has
// why it fired, its chain, its audit trail, its AI summary, the buttons GET /alarms/{id}/actions
// allows, and shelving.
//
// A stable list under load: live updates read the list at most every LIVE_MS (so at most a few
// repaints a second, whatever the event rate) and reuse each alarm's row. While the operator is
// on the list (the pointer moved onto a row, an alarm open, a box ticked) a live update never
// moves a row: rows change in place, alarms gone stay (dimmed), and new alarms wait behind an "N new"
// bar until the operator opens it. `window.__alarmRepaints` counts the list's repaints.
import { query } from "./api.js";
import { append, clear, deviceHref, el, now, readings, throttle, timeEl, when } from "./util.js";

const SEVERITY_RANK = { CRITICAL: 4, MAJOR: 3, WARNING: 2, INFO: 1 };
const SEVERITIES = ["CRITICAL", "MAJOR", "WARNING", "INFO"];
const OPEN = new Set(["NEW", "PUSHED", "DELAYED", "CONFIRMED", "ESCALATED"]);
const PAGE = 200;
const LIVE_MS = 400;
// A shelf's end at its until is told by a node's alarm timers (shelf.ended) when they pass;
// the list is also read again just after the soonest end of a shelf in force, so the alarm
// returns on time (at most once a second, however the clocks of the page and the gateway differ).
const SHELF_END_MARGIN_MS = 250;
const SHELF_RECHECK_MIN_MS = 1000;
const TIMER_MAX_MS = 2 ** 31 - 1;
const ACTION_LABELS = { confirm: "Confirm", handle: "Mark handled", close: "Close", false: "False alarm" };
const SHELVE_FOR = [["900", "15 min"], ["3600", "1 h"], ["14400", "4 h"], ["28800", "8 h"], ["86400", "24 h"]];
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
  // Raised before alarms kept their reason: an upgrade left only the sample's time.
  if ("sample_ts" in trigger) return `the sample of ${when(trigger.sample_ts)} (no reason kept: raised by an older release)`;
  return JSON.stringify(trigger);
}

export class AlarmsView {
  constructor(ctx) {
    this.ctx = ctx;
    this.root = document.getElementById("view-alarms");
    this.form = document.getElementById("alarm-filters");
    this.list = document.getElementById("alarm-list");
    this.activeBody = document.querySelector("#alarm-table tbody");
    this.returnedBody = document.querySelector("#alarm-returned tbody");
    this.returnedTitle = document.getElementById("alarm-returned-title");
    this.returnedTable = document.getElementById("alarm-returned");
    this.activeTitle = document.getElementById("alarm-active-title");
    this.activeTable = document.getElementById("alarm-table");
    this.groupsTable = document.getElementById("alarm-groups");
    this.counts = document.getElementById("alarm-counts");
    this.newBar = document.getElementById("alarm-new");
    this.bulkBar = document.getElementById("bulk-bar");
    this.bulkResults = document.getElementById("bulk-results");
    this.empty = document.getElementById("alarm-empty");
    this.more = document.getElementById("alarm-more");
    this.detail = document.getElementById("alarm-detail");
    this.items = [];
    this.byId = new Map();
    this.shown = { active: [], returned: [] };
    this.pending = new Set();
    this.present = new Set();
    this.rows = new Map();
    this.signatures = new Map();
    this.checked = new Set();
    this.checkedGroups = new Set();
    this.groups = [];
    this.expanded = new Map();
    this.nextBefore = null;
    this.selected = null;
    this.hovering = false;
    this.loaded = false;
    this.asked = false;
    this.stale = false;
    // Only the newest reading of the list is shown (util.readings): a live update overtaken
    // by the operator's Filter, a slow answer to the filters before, are dropped.
    this.reading = readings();
    // And of the detail: an answer for the alarm opened before (a quick second click, a live
    // refresh overtaken by an action's) never paints over the one now open, whose buttons act.
    this.detailReading = readings();
    window.__alarmRepaints = 0;
    this.refreshListSoon = throttle(() => this.load(false, { live: true }), LIVE_MS);
    this.refreshDetailSoon = throttle(() => this.selected === null ? null : this.open(this.selected, { keepFocus: true }), LIVE_MS);
    this.form.addEventListener("submit", (event) => {
      event.preventDefault();
      this.refresh();
    });
    this.more.addEventListener("click", () => this.load(true));
    this.newBar.addEventListener("click", () => this.load(false));
    // The pointer on a row: only a pointer that moved there counts (a browser reports a pointer
    // at rest as moving when the content under it changes; a row that arrived under a resting
    // pointer is not one the operator pointed at).
    document.addEventListener("pointermove", (event) => {
      const last = this.lastPointer;
      const moved = !last || last[0] !== event.clientX || last[1] !== event.clientY;
      this.lastPointer = [event.clientX, event.clientY];
      if (moved) this.hovering = this.list.contains(event.target) && Boolean(event.target.closest("tbody tr"));
    });
    this.list.addEventListener("pointerleave", () => { this.hovering = false; });
    for (const button of this.bulkBar.querySelectorAll("button[data-bulk]")) {
      button.addEventListener("click", () => this.bulk(button.dataset.bulk));
    }
    document.getElementById("bulk-clear").addEventListener("click", () => {
      this.checked.clear();
      this.checkedGroups.clear();
      this.render();
    });
  }

  // The operator is on the list: live updates must not move anything.
  pinned() {
    if (this.shown.active.length + this.shown.returned.length === 0) return false; // nothing to move
    return this.selected !== null || this.hovering || this.checked.size > 0 || this.checkedGroups.size > 0;
  }

  filters() {
    const data = new FormData(this.form);
    return {
      status: data.get("status"),
      severity: data.get("severity"),
      device: data.get("device").trim(),
      rule: data.get("rule").trim(),
      shelved: data.get("shelved") || "false",
      group: data.get("group") || "",
    };
  }

  setFilters(values) {
    for (const [name, value] of Object.entries(values)) {
      if (this.form.elements[name] && value !== undefined) this.form.elements[name].value = value;
    }
  }

  // The filters as the API takes them (GET /alarms, /alarms/groups, a bulk group's filters).
  apiFilters() {
    const f = this.filters();
    return {
      open: f.status === "open" ? true : null,
      status: f.status && f.status !== "open" ? [f.status] : null,
      device: f.device || null,
      rule: f.rule || null,
      severity: f.severity || null,
      shelved: f.shelved === "false" ? null : f.shelved,
    };
  }

  async show(id, params) {
    const filtered = params && (params.device || params.rule);
    if (filtered) {
      this.setFilters({ device: params.device || "", rule: params.rule || "", status: "" });
    }
    // Opening an alarm of the list does not read the list again (that would move its rows).
    if (!this.loaded || this.stale || filtered) await this.load(false);
    if (id) await this.open(Number(id));
    else this.close();
  }

  async refresh() {
    await this.load(false);
    if (this.selected !== null) await this.open(this.selected, { keepFocus: true });
  }

  async load(append, { live = false } = {}) {
    const f = this.filters();
    const params = { ...this.apiFilters(), limit: PAGE, before: append ? this.nextBefore : null };
    const current = this.reading();
    if (!live) {
      // Asked for (Filter, the bar, a link): the answer orders the list afresh, even when a
      // live update overtakes this reading and answers in its place. Busy until then (for
      // assistive technology, and for a test to know the list answers its filters).
      this.asked = true;
      this.list.setAttribute("aria-busy", "true");
    }
    let page, counts, groups = null;
    try {
      [page, counts, groups] = await Promise.all([
        this.ctx.api.get(`/alarms${query(params)}`),
        this.ctx.api.get("/alarms/counts"),
        f.group ? this.ctx.api.get(`/alarms/groups${query({ ...this.apiFilters(), by: f.group, limit: PAGE })}`) : null,
      ]);
      if (!current()) return;
      if (live && !append && this.keepTo !== null && this.keepTo !== undefined) {
        // The operator loaded older pages: a live update reads the list down to the oldest
        // alarm shown, or those would drop off (or be marked gone while still in the view).
        let items = page.items;
        let next = page.next_before;
        while (next !== null && next !== undefined && next > this.keepTo) {
          const more = await this.ctx.api.get(`/alarms${query({ ...params, before: next })}`);
          if (!current()) return;
          items = [...items, ...more.items];
          next = more.next_before;
        }
        page = { items, next_before: next };
      }
      if (f.group !== this.groupedBy) {
        this.expanded.clear();
        this.groupedBy = f.group;
      }
      if (f.group) await this.loadExpanded(f.group);
    } catch (error) {
      if (!current()) return;
      this.asked = false;
      this.list.setAttribute("aria-busy", "false");
      this.ctx.notify(`Alarms: ${error.message}`);
      return;
    }
    if (!current()) return;
    this.list.setAttribute("aria-busy", "false");
    this.loaded = true;
    this.stale = false;
    this.items = append ? [...this.items, ...page.items] : page.items;
    for (const alarm of this.items) this.byId.set(alarm.id, alarm);
    this.nextBefore = page.next_before;
    // How far down the list the operator asked to see (null: the first page alone).
    if (append) this.keepTo = this.items.length ? this.items[this.items.length - 1].id : this.keepTo;
    else if (!live) this.keepTo = null;
    this.countsBody = counts;
    this.groups = groups ? groups.items : [];
    // More groups than one page (a storm over many devices): said, never silently cut.
    this.groupsMore = Boolean(groups && groups.next_before);
    const fresh = this.sections(this.items);
    if (live && !this.asked && this.pinned()) {
      // Nothing moves: the rows shown stay where they are; what is new waits behind the bar.
      const showing = new Set([...this.shown.active, ...this.shown.returned]);
      for (const id of [...fresh.active, ...fresh.returned]) if (!showing.has(id)) this.pending.add(id);
    } else {
      this.shown = fresh;
      this.pending.clear();
      // Ordered afresh (Filter, the bar, a link): a tick stays only on what the list now
      // shows, so a bulk action never acts on an alarm (or a group) the operator no longer sees.
      const visible = new Set(f.group
        ? [...this.expanded.keys()].flatMap((key) => (this.groupItems && this.groupItems.get(key)) || []).map((a) => a.id)
        : [...fresh.active, ...fresh.returned]);
      for (const id of [...this.checked]) if (!visible.has(id)) this.checked.delete(id);
      const keys = new Set(this.groups.map((g) => g.key));
      for (const key of [...this.checkedGroups]) if (!keys.has(key)) this.checkedGroups.delete(key);
    }
    this.asked = false;
    this.present = new Set(this.items.map((a) => a.id));
    this.render();
    this.forget();
    this.watchShelfEnds(counts, this.items);
  }

  // The rows (and what they show) of alarms the page neither lists nor may draw again are
  // dropped: alarms come and go all day, and a page open on a control room's screen would
  // otherwise hold every row it ever drew.
  forget() {
    const keep = new Set([...this.items.map((a) => a.id), ...this.shown.active, ...this.shown.returned,
      ...this.pending, ...this.checked]);
    if (this.selected !== null) keep.add(this.selected);
    if (this.groupItems) for (const items of this.groupItems.values()) for (const alarm of items) keep.add(alarm.id);
    for (const map of [this.rows, this.signatures, this.byId]) {
      for (const id of [...map.keys()]) if (!keep.has(id)) map.delete(id);
    }
  }

  // An unshelved alarm returns to annunciation (behaviour §5) at its shelf's until, whereas
  // the expiry's shelf.ended comes when a node's alarm timers next pass: read the list again
  // just after the soonest end of a shelf in force, as a live update.
  async watchShelfEnds(counts, items) {
    const ends = items.filter((a) => a.shelved_until).map((a) => Date.parse(a.shelved_until));
    if (counts && counts.all && counts.all.shelved > 0) {
      try {
        const shelves = await this.ctx.api.get("/shelves?limit=500");
        for (const shelf of shelves.items) ends.push(Date.parse(shelf.until));
      } catch { /* the next reading of the list tries again */ }
    }
    clearTimeout(this.shelfTimer);
    this.shelfTimer = null;
    const soonest = Math.min(...ends.filter((t) => Number.isFinite(t)));
    if (!Number.isFinite(soonest)) return;
    const wait = Math.max(soonest - now() + SHELF_END_MARGIN_MS, SHELF_RECHECK_MIN_MS);
    this.shelfTimer = setTimeout(() => {
      this.shelfTimer = null;
      if (this.ctx.current() !== "alarms") this.stale = true;
      else this.refreshListSoon();
    }, Math.min(wait, TIMER_MAX_MS));
  }

  async loadExpanded(by) {
    for (const key of this.expanded.keys()) {
      const params = { ...this.apiFilters(), [by]: key, limit: 50 };
      this.expanded.set(key, by);
      this.groupItems = this.groupItems || new Map();
      this.groupItems.set(key, (await this.ctx.api.get(`/alarms${query(params)}`)).items);
    }
  }

  // Active alarms (most severe first), and those returned to normal (unacknowledged first).
  sections(items) {
    const active = order(items.filter((a) => a.active !== false)).map((a) => a.id);
    const back = items.filter((a) => a.active === false);
    const returned = [
      ...order(back.filter((a) => !a.acknowledged)), ...order(back.filter((a) => a.acknowledged)),
    ].map((a) => a.id);
    return { active, returned };
  }

  render() {
    window.__alarmRepaints += 1;
    this.renderCounts();
    const grouped = Boolean(this.filters().group);
    this.groupsTable.hidden = !grouped;
    for (const node of [this.activeTitle, this.activeTable]) node.hidden = grouped;
    this.reconcile(this.activeBody, grouped ? [] : this.shown.active);
    this.reconcile(this.returnedBody, grouped ? [] : this.shown.returned);
    const anyReturned = !grouped && this.shown.returned.length > 0;
    this.returnedTitle.hidden = !anyReturned;
    this.returnedTable.hidden = !anyReturned;
    if (grouped) this.renderGroups();
    const count = this.pending.size;
    this.newBar.classList.toggle("none", count === 0);
    this.newBar.textContent = count === 1 ? "1 new alarm: show it" : `${count} new alarms: show them`;
    const nothing = grouped ? this.groups.length === 0 : this.shown.active.length + this.shown.returned.length === 0;
    this.empty.hidden = !nothing;
    this.more.hidden = grouped || this.nextBefore === null || this.nextBefore === undefined;
    this.renderBulkBar();
  }

  renderCounts() {
    const body = this.countsBody;
    if (!body) return;
    const all = body.all;
    const parts = [el("strong", { text: `${all.total} open` })];
    for (const severity of SEVERITIES) {
      const c = body.by_severity[severity];
      if (!c) continue;
      parts.push(el("span", { class: `count-sev${c.total ? "" : " count-zero"}`, dataset: { severity } },
        severityBadge(severity),
        el("span", { class: "count-active", title: "active (unacknowledged / acknowledged)", text: `active ${c.active_unacknowledged}/${c.active_acknowledged}` }),
        el("span", { class: "count-returned", title: "returned to normal, unacknowledged", text: `returned ${c.returned_unacknowledged}` }),
        el("span", { class: "count-shelved", text: `shelved ${c.shelved}` })));
    }
    parts.push(el("span", { class: "count-total-shelved", text: `shelved ${all.shelved}` }));
    parts.push(el("span", { class: "count-oos", text: `out of service ${all.out_of_service}` }));
    this.counts.replaceChildren(...parts);
  }

  // The rows of `ids` in `body`, in that order, each alarm's row reused (and redrawn only when
  // something it shows changed): an unchanged row is never touched.
  reconcile(body, ids) {
    const wanted = ids.map((id) => this.rowFor(id));
    for (const [index, row] of wanted.entries()) {
      if (body.children[index] !== row) body.insertBefore(row, body.children[index] || null);
    }
    while (body.children.length > wanted.length) body.lastElementChild.remove();
  }

  rowFor(id) {
    const alarm = this.byId.get(id);
    const gone = !this.present.has(id);
    const signature = JSON.stringify([alarm, gone, this.selected === id, this.checked.has(id), this.ctx.canAct()]);
    let row = this.rows.get(id);
    if (row && this.signatures.get(id) === signature) return row;
    if (!row) {
      row = el("tr", { dataset: { alarmId: id } });
      this.rows.set(id, row);
    }
    this.signatures.set(id, signature);
    row.className = [id === this.selected ? "selected" : "", gone ? "gone" : ""].join(" ").trim();
    row.replaceChildren(...this.cells(alarm, gone));
    return row;
  }

  checkbox(id) {
    if (!this.ctx.canAct()) return el("td", { class: "pick" });
    const box = el("input", { type: "checkbox", "aria-label": `Select alarm #${id}`, checked: this.checked.has(id) });
    box.addEventListener("change", () => {
      if (box.checked) this.checked.add(id); else this.checked.delete(id);
      this.renderBulkBar();
    });
    return el("td", { class: "pick" }, box);
  }

  cells(alarm, gone) {
    const link = el("a", { href: `#/alarms/${alarm.id}`, text: `#${alarm.id}` });
    const tags = [
      alarm.active === false && !alarm.acknowledged ? el("span", { class: "tag tag-unack", text: "unacknowledged" }) : null,
      alarm.shelved_until ? el("span", { class: "tag tag-shelved", text: `shelved until ${when(alarm.shelved_until)}` }) : null,
      alarm.out_of_service ? el("span", { class: "tag tag-oos", text: "out of service" }) : null,
      gone ? el("span", { class: "tag", text: "changed: no longer in this view" }) : null,
    ];
    return [
      this.checkbox(alarm.id),
      el("td", { "data-label": "Severity" }, severityBadge(alarm.severity)),
      el("td", { "data-label": "Alarm" }, link, ...tags, alarm.rule_description ? el("div", { class: "hint", text: alarm.rule_description }) : null),
      el("td", { "data-label": "Device" }, el("a", { href: `#/devices/${encodeURIComponent(alarm.device_id)}`, text: alarm.device_id })),
      el("td", { "data-label": "Rule", text: alarm.rule_key }),
      el("td", { "data-label": "Status" }, el("span", { class: "status", text: alarm.status })),
      el("td", { "data-label": "Triggered" }, timeEl(alarm.triggered_at)),
    ];
  }

  renderGroups() {
    const body = this.groupsTable.querySelector("tbody");
    const by = this.filters().group;
    const rows = [];
    for (const group of this.groups) {
      const open = this.expanded.has(group.key);
      const pick = this.ctx.canAct() ? el("input", { type: "checkbox", "aria-label": `Select every alarm of ${group.key}`, checked: this.checkedGroups.has(group.key) }) : null;
      if (pick) pick.addEventListener("change", () => {
        if (pick.checked) this.checkedGroups.add(group.key); else this.checkedGroups.delete(group.key);
        this.renderBulkBar();
      });
      const toggle = el("button", {
        type: "button", class: "group-toggle", "aria-expanded": open ? "true" : "false",
        text: `${open ? "▾" : "▸"} ${group.key}`,
        onclick: () => this.toggleGroup(group.key),
      });
      rows.push(el("tr", { class: "group-row", dataset: { group: group.key } },
        el("td", { class: "pick" }, pick),
        el("td", { "data-label": by === "rule" ? "Rule" : "Device" }, toggle),
        el("td", { "data-label": "Alarms", class: "group-count", text: String(group.count) }),
        el("td", { "data-label": "Worst" }, severityBadge(group.worst_severity)),
        el("td", { "data-label": "Newest" }, timeEl(group.newest_at))));
      if (open) {
        for (const alarm of (this.groupItems && this.groupItems.get(group.key)) || []) {
          this.byId.set(alarm.id, alarm);
          rows.push(el("tr", { class: "group-alarm", dataset: { alarmId: alarm.id } },
            this.checkbox(alarm.id),
            el("td", { "data-label": "Alarm" }, el("a", { href: `#/alarms/${alarm.id}`, text: `#${alarm.id}` }), " ", severityBadge(alarm.severity)),
            el("td", { "data-label": by === "rule" ? "Device" : "Rule", text: by === "rule" ? alarm.device_id : alarm.rule_key }),
            el("td", { "data-label": "Status" }, el("span", { class: "status", text: alarm.status })),
            el("td", { "data-label": "Triggered" }, timeEl(alarm.triggered_at))));
        }
      }
    }
    if (this.groupsMore) {
      rows.push(el("tr", { class: "group-more" }, el("td", { colspan: "5",
        text: `More groups than the ${this.groups.length} shown (worst first, then newest): narrow the filters to see the rest.` })));
    }
    body.replaceChildren(...rows);
  }

  async toggleGroup(key) {
    if (this.expanded.has(key)) this.expanded.delete(key);
    else this.expanded.set(key, this.filters().group);
    try {
      await this.loadExpanded(this.filters().group);
    } catch (error) {
      this.ctx.notify(`Alarms: ${error.message}`);
    }
    this.render();
  }

  renderBulkBar() {
    const n = this.checked.size;
    const g = this.checkedGroups.size;
    this.bulkBar.hidden = !this.ctx.canAct() || n + g === 0;
    const parts = [];
    if (n) parts.push(n === 1 ? "1 alarm" : `${n} alarms`);
    if (g) parts.push(g === 1 ? "1 group" : `${g} groups`);
    document.getElementById("bulk-count").textContent = `${parts.join(" and ")} selected:`;
  }

  async bulk(action) {
    const buttons = this.bulkBar.querySelectorAll("button");
    for (const b of buttons) b.disabled = true;
    const by = this.filters().group;
    const requests = [];
    if (this.checked.size) requests.push({ action, ids: [...this.checked] });
    for (const key of this.checkedGroups) {
      // The group as the page shows it: alarms raised since (not yet drawn) are left alone.
      const group = { by, key, filters: this.groupFilters() };
      const shown = this.groups.find((g) => g.key === key);
      if (shown && shown.newest_id) group.up_to = shown.newest_id;
      // ... and those committed after the read, whose ids may be lower (ids commit out of order).
      if (shown && shown.as_of) group.as_of = shown.as_of;
      requests.push({ action, group });
    }
    const lines = [];
    for (const body of requests) {
      try {
        const reply = await this.ctx.api.post("/alarms/bulk", body);
        for (const item of reply.items) {
          lines.push(item.ok
            ? el("li", { class: "done", dataset: { alarmId: item.alarm_id }, text: `#${item.alarm_id}: ${item.status}` })
            : el("li", { class: "refused", dataset: { alarmId: item.alarm_id }, text: `#${item.alarm_id}: refused (${item.error}${item.current_status ? `, ${item.current_status}` : ""}): ${item.message}` }));
        }
      } catch (error) {
        lines.push(el("li", { class: "refused", text: `Refused: ${error.message}` }));
      }
    }
    this.bulkResults.replaceChildren(...lines);
    this.bulkResults.hidden = lines.length === 0;
    for (const b of buttons) b.disabled = false;
    this.checked.clear();
    this.checkedGroups.clear();
    await this.load(false);
    if (this.selected !== null) await this.open(this.selected, { keepFocus: true });
  }

  // A group's filters, as POST /alarms/bulk takes them (booleans, not text).
  groupFilters() {
    const f = this.apiFilters();
    const out = { shelved: f.shelved || "false" };
    if (f.open) out.open = true;
    if (f.status) out.status = f.status;
    if (f.device) out.device = f.device;
    if (f.rule) out.rule = f.rule;
    if (f.severity) out.severity = f.severity;
    return out;
  }

  close() {
    this.detailReading(); // an answer on its way for the detail closed is dropped
    this.selected = null;
    this.detail.hidden = true;
    clear(this.detail);
    this.render();
  }

  async open(id, { keepFocus = false } = {}) {
    const api = this.ctx.api;
    const current = this.detailReading();
    // Selected at once: a live refresh on its way reads this alarm, not the one shown before.
    this.selected = id;
    let alarm, actions, chain, audit;
    try {
      [alarm, actions, chain, audit] = await Promise.all([
        api.get(`/alarms/${id}`), api.get(`/alarms/${id}/actions`),
        api.get(`/alarms/${id}/chain`), api.get(`/alarms/${id}/audit`),
      ]);
    } catch (error) {
      if (!current()) return;
      // Another alarm's detail must not stay under this one's selection (its buttons act).
      if (this.detail.hidden || this.detail.dataset.alarmId !== String(id)) this.close();
      this.ctx.notify(`Alarm #${id}: ${error.message}`);
      return;
    }
    if (!current()) return;
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
        // A threshold alarm leads to its reading in context: the device's chart on the alarm's
        // metric, with the rule's trigger and clear lines.
        alarm.trigger && alarm.trigger.metric ? [el("dt", { text: "Chart" }), el("dd", {}, el("a", { class: "alarm-chart", href: deviceHref(alarm.device_id, { metric: alarm.trigger.metric, rule: alarm.rule_key }), text: `${alarm.trigger.metric} on ${alarm.device_id}` }))] : null,
        el("dt", { text: "Why" }), el("dd", { class: "trigger", text: describeTrigger(alarm.trigger) }),
        el("dt", { text: "Rule says" }), el("dd", { class: "rule-description", text: alarm.rule_description || "—" }),
        el("dt", { text: "Triggered" }), el("dd", {}, timeEl(alarm.triggered_at)),
        el("dt", { text: "Condition" }), el("dd", { class: "condition", text: alarm.active === false ? "returned to normal" : "active" }),
        el("dt", { text: "Acknowledged" }), el("dd", { class: "acknowledged", text: alarm.acknowledged ? "yes" : "no" }),
        alarm.cleared_at ? [el("dt", { text: "Cleared" }), el("dd", {}, timeEl(alarm.cleared_at))] : null,
        alarm.shelved_until ? [el("dt", { text: "Shelved until" }), el("dd", { class: "shelved" }, timeEl(alarm.shelved_until))] : null,
        alarm.out_of_service ? [el("dt", { text: "Out of service" }), el("dd", { text: "raised while its device was out of service: not notified" })] : null,
        alarm.superseded_by ? [el("dt", { text: "Superseded by" }), el("dd", {}, el("a", { href: `#/alarms/${alarm.superseded_by}`, text: `#${alarm.superseded_by}` }))] : null),
    );
    append(d, this.renderActions(alarm, actions));
    append(d, this.renderShelving(alarm));
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

  // Shelve this alarm (or its rule on its device) for a while, with a reason; or lift it.
  renderShelving(alarm) {
    if (!this.ctx.canAct() || !OPEN.has(alarm.status)) return null;
    const box = el("div", { class: "shelve", role: "group", "aria-label": "Shelving" });
    if (alarm.shelved_until) {
      box.append(el("button", { type: "button", class: "unshelve", text: "Unshelve", onclick: () => this.unshelve(alarm) }));
      return box;
    }
    const id = alarm.id;
    const scope = el("select", { id: `shelve-scope-${id}` },
      el("option", { value: "alarm", text: "this alarm" }),
      el("option", { value: "pair", text: `${alarm.rule_key} on ${alarm.device_id}` }));
    const duration = el("select", { id: `shelve-for-${id}` }, SHELVE_FOR.map(([value, label]) => el("option", { value, text: label })));
    const reason = el("input", { id: `shelve-reason-${id}`, type: "text", maxlength: "500", autocomplete: "off", required: true });
    box.append(
      el("label", { for: scope.id }, "Shelve", scope),
      el("label", { for: duration.id }, "for", duration),
      el("label", { for: reason.id }, "Reason", reason),
      el("button", { type: "button", class: "shelve-button", text: "Shelve", onclick: () => this.shelve(alarm, scope.value, Number(duration.value), reason.value) }));
    return box;
  }

  async shelve(alarm, scope, seconds, reason) {
    if (!reason.trim()) {
      this.ctx.notify("Shelving needs a reason.");
      return;
    }
    try {
      await this.ctx.api.post(`/alarms/${alarm.id}/shelve`, { scope, duration_s: seconds, reason: reason.trim() });
      this.ctx.notify(`Alarm #${alarm.id} shelved.`, "ok");
    } catch (error) {
      this.ctx.notify(`Could not shelve alarm #${alarm.id}: ${error.message}`);
    }
    await this.load(false);
    await this.open(alarm.id, { keepFocus: true });
  }

  // Every shelf in force that covers the alarm is lifted: its own, and its rule's on its
  // device (two operators may have shelved it both ways); one lifted meanwhile by someone
  // else (409 SHELF_ENDED) is lifted already.
  async unshelve(alarm) {
    try {
      const covering = [];
      let before = null;
      do {
        const page = await this.ctx.api.get(`/shelves${query({ limit: 500, before })}`);
        covering.push(...page.items.filter((s) => (s.scope === "alarm" && s.alarm_id === alarm.id)
          || (s.scope === "pair" && s.device_id === alarm.device_id && s.rule_key === alarm.rule_key)));
        before = page.next_before;
      } while (before !== null && before !== undefined);
      if (!covering.length) throw new Error("its shelf has ended already");
      for (const shelf of covering) {
        try {
          await this.ctx.api.delete(`/shelves/${shelf.id}`);
        } catch (error) {
          if (error.code !== "SHELF_ENDED") throw error;
        }
      }
      this.ctx.notify(`Alarm #${alarm.id} unshelved.`, "ok");
    } catch (error) {
      this.ctx.notify(`Could not unshelve alarm #${alarm.id}: ${error.message}`);
    }
    await this.load(false);
    await this.open(alarm.id, { keepFocus: true });
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
    // As a live update: the alarm acted on, open in the detail, does not move.
    await this.load(false, { live: true });
    await this.open(id, { keepFocus: true });
    const again = this.detail.querySelector(`.actions button[data-action="${action}"]`) || this.detail.querySelector(".actions button") || this.detail.querySelector("h3");
    if (button) again.focus();
  }

  // A race lost (409), or a button that went stale (someone acted since the page drew it):
  // say who did it, from the answer or from the audit trail. A 409's actor took this very
  // step only when the alarm records them for it; else they took another step first.
  async refusal(id, action, error) {
    const step = { confirm: "confirmed", handle: "handled", close: "closed", false: "false" }[action];
    const alarm = error.body && error.body.alarm;
    if (error.status === 409 && error.body.actor && alarm && alarm[`${step}_by`] === error.body.actor) {
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

  // An alarm's events, and a shelf made or ended (by another operator, or at its end): a
  // shelved alarm leaves the default list and an unshelved one returns to it.
  onEvent(event) {
    const shelf = event.aggregate_type === "shelf";
    if (event.aggregate_type !== "alarm" && !shelf) return;
    if (this.ctx.current() !== "alarms") {
      this.stale = true;
      return;
    }
    this.refreshListSoon();
    // The detail is drawn again only for its own alarm: a note being typed is kept.
    const ids = shelf ? (event.payload.alarm_ids || []).map(String) : [String(event.aggregate_id)];
    if (this.selected !== null && ids.includes(String(this.selected))) this.refreshDetailSoon();
  }
}
