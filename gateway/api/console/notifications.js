// Notifications: the deliveries (one per event and receiver; a FAILED one says why in
// last_error) and the silences (operators create and expire them; viewers read).
// A delivery's progress is no stream event, and a delivery is made a moment after the event it
// is for: while the section is shown its list is read again every 3 s when one shown is PENDING
// or SENDING, every 10 s otherwise; alarm, command and campaign events read it too, throttled.
import { query } from "./api.js";
import { clear, el, readings, throttle, timeEl, when } from "./util.js";

const PAGE = 50;
const OPEN = new Set(["PENDING", "SENDING"]);

// No answer, or one from something in between that does not know what the gateway did.
function outcomeUnknown(error) {
  return error.status === 0 || error.status === 502 || error.status === 504;
}

function list(text) {
  return text.split(",").map((s) => s.trim()).filter(Boolean);
}

function matcherText(matchers) {
  const parts = [];
  if (matchers.rules) parts.push(`rules ${matchers.rules.join(", ")}`);
  if (matchers.devices) parts.push(`devices ${[].concat(matchers.devices).join(", ")}`);
  if (matchers.severities) parts.push(`severities ${matchers.severities.join(", ")}`);
  return parts.length ? parts.join("; ") : "everything";
}

export class NotificationsView {
  constructor(ctx) {
    this.ctx = ctx;
    this.deliveryReading = readings();
    this.silenceReading = readings();
    this.filters = document.getElementById("delivery-filters");
    this.deliveryBody = document.querySelector("#delivery-table tbody");
    this.deliveryEmpty = document.getElementById("delivery-empty");
    this.deliveryMore = document.getElementById("delivery-more");
    this.create = document.getElementById("silence-create");
    this.silenceBody = document.querySelector("#silence-table tbody");
    this.silenceEmpty = document.getElementById("silence-empty");
    this.silenceMore = document.getElementById("silence-more");
    this.deliveries = [];
    this.deliveriesNext = null;
    this.silences = [];
    this.silencesNext = null;
    this.poll = null;
    this.filters.addEventListener("submit", (event) => {
      event.preventDefault();
      this.loadDeliveries(false);
    });
    this.deliveryMore.addEventListener("click", () => this.loadDeliveries(true));
    this.silenceMore.addEventListener("click", () => this.loadSilences(true));
    this.create.addEventListener("submit", (event) => {
      event.preventDefault();
      this.createSilence();
    });
    this.refreshSoon = throttle(() => this.loadDeliveries(false), 1000);
  }

  async show() {
    await Promise.all([this.loadDeliveries(false), this.loadSilences(false)]);
  }

  refresh() { return this.show(); }

  hide() {
    clearTimeout(this.poll);
    this.poll = null;
  }

  async loadDeliveries(append) {
    const form = new FormData(this.filters);
    const params = {
      status: form.get("status"),
      receiver: form.get("receiver").trim(),
      limit: PAGE,
      before: append ? this.deliveriesNext : null,
    };
    const current = this.deliveryReading();
    let page;
    try {
      page = await this.ctx.api.get(`/deliveries${query(params)}`);
    } catch (error) {
      if (current()) this.ctx.notify(`Deliveries: ${error.message}`);
      return;
    }
    if (!current()) return;
    this.deliveries = append ? [...this.deliveries, ...page.items] : page.items;
    this.deliveriesNext = page.next_before ?? null;
    this.renderDeliveries();
  }

  renderDeliveries() {
    clear(this.deliveryBody);
    for (const d of this.deliveries) {
      // The alarm it is about, as a link to the alarm itself.
      const about = [d.device_id, d.rule_key].filter(Boolean).join(" · ");
      const subject = d.alarm_id || about
        ? el("div", { class: "hint" },
          d.alarm_id ? el("a", { href: `#/alarms/${d.alarm_id}`, class: "delivery-alarm", text: `alarm ${d.alarm_id}` }) : null,
          d.alarm_id && about ? " · " : null,
          about || null)
        : null;
      this.deliveryBody.append(el("tr", { class: d.status === "FAILED" ? "failed" : null, dataset: { deliveryId: d.id, status: d.status } },
        el("td", { "data-label": "Id", class: "num", text: String(d.id) }),
        el("td", { "data-label": "Event" }, el("span", { text: d.event }), subject),
        el("td", { "data-label": "Receiver", text: d.receiver }),
        el("td", { "data-label": "Status" }, el("span", { class: `status delivery-${d.status}`, text: d.status }),
          d.suppressed ? el("div", { class: "hint suppressed", text: d.suppressed }) : null),
        el("td", { "data-label": "Attempts", class: "num", text: String(d.attempts) }),
        el("td", { "data-label": "Last error", class: "last-error", text: d.last_error || "" }),
        el("td", { "data-label": "Event time" }, timeEl(d.event_created_at)),
        el("td", { "data-label": d.finished_at ? "Finished" : "Next attempt" },
          d.finished_at ? timeEl(d.finished_at) : (OPEN.has(d.status) ? timeEl(d.next_attempt_at) : null))));
    }
    this.deliveryEmpty.hidden = this.deliveries.length > 0;
    this.deliveryMore.hidden = this.deliveriesNext === null;
    clearTimeout(this.poll);
    this.poll = null;
    // Once "Older deliveries" loaded more than the first page, the list stays as it is
    // (reading the first page again would drop the older ones): Filter reads it again.
    if (this.ctx.current() === "notifications" && this.deliveries.length <= PAGE) {
      const open = this.deliveries.some((d) => OPEN.has(d.status));
      this.poll = setTimeout(() => {
        if (this.ctx.current() === "notifications") this.loadDeliveries(false);
      }, open ? 3000 : 10000);
    }
  }

  async loadSilences(append) {
    const current = this.silenceReading();
    let page;
    try {
      page = await this.ctx.api.get(`/silences${query({ limit: PAGE, before: append ? this.silencesNext : null })}`);
    } catch (error) {
      if (current()) this.ctx.notify(`Silences: ${error.message}`);
      return;
    }
    if (!current()) return;
    this.silences = append ? [...this.silences, ...page.items] : page.items;
    this.silencesNext = page.next_before ?? null;
    this.renderSilences();
  }

  renderSilences() {
    clear(this.silenceBody);
    for (const s of this.silences) {
      const expire = this.ctx.canAct() && s.active
        ? el("button", { type: "button", class: "secondary", text: "Expire", "aria-label": `Expire silence ${s.id}`, onclick: () => this.expire(s.id) })
        : null;
      this.silenceBody.append(el("tr", { dataset: { silenceId: s.id } },
        el("td", { "data-label": "Id", class: "num", text: String(s.id) }),
        el("td", { "data-label": "Matches", text: matcherText(s.matchers || {}) }),
        el("td", { "data-label": "Active", class: "active", text: s.active ? "active" : (s.expired_by ? `expired by ${s.expired_by}` : "ended") }),
        el("td", { "data-label": "Starts" }, timeEl(s.starts_at)),
        el("td", { "data-label": "Ends" }, timeEl(s.ends_at)),
        el("td", { "data-label": "Comment", text: s.comment }),
        el("td", { "data-label": "By", text: s.created_by }),
        el("td", {}, expire)));
    }
    this.silenceEmpty.hidden = this.silences.length > 0;
    this.silenceMore.hidden = this.silencesNext === null;
  }

  async createSilence() {
    const form = new FormData(this.create);
    const endsAt = new Date(form.get("ends_at"));
    if (Number.isNaN(endsAt.getTime())) {
      this.ctx.notify("A silence needs an end time.");
      return;
    }
    const matchers = {};
    const rules = list(form.get("rules"));
    const devices = list(form.get("devices"));
    const severities = form.getAll("severities");
    if (rules.length) matchers.rules = rules;
    if (devices.length) matchers.devices = devices;
    if (severities.length) matchers.severities = severities;
    const comment = form.get("comment").trim();
    const newest = Math.max(0, ...this.silences.map((s) => s.id));
    try {
      const silence = await this.ctx.api.post("/silences", { matchers, ends_at: endsAt.toISOString(), comment });
      this.ctx.notify(`Silence ${silence.id} created, until ${when(silence.ends_at)}.`, "ok");
      this.create.reset();
    } catch (error) {
      if (!outcomeUnknown(error)) {
        this.ctx.notify(`Could not create the silence: ${error.message}`);
      } else {
        // No answer: the gateway may well have created it, and created again it would be two
        // (expiring one would leave the other muting). The list read again says.
        await this.loadSilences(false);
        const made = this.silences.find((s) => s.id > newest && s.comment === comment && Date.parse(s.ends_at) === endsAt.getTime());
        if (made) {
          this.ctx.notify(`Silence ${made.id} created, until ${when(made.ends_at)} (its answer was lost on the way: the list shows it).`, "ok");
          this.create.reset();
        } else {
          this.ctx.notify(`No answer from the gateway (${error.message}); the list shows no such silence yet. Look again before creating it again: two would mute alike.`);
        }
        return;
      }
    }
    await this.loadSilences(false);
  }

  async expire(id) {
    try {
      await this.ctx.api.delete(`/silences/${id}`);
      this.ctx.notify(`Silence ${id} expired.`, "ok");
    } catch (error) {
      if (outcomeUnknown(error)) {
        // No answer: the gateway may well have expired it. The list read again says.
        await this.loadSilences(false);
        const silence = this.silences.find((s) => s.id === id);
        if (silence && !silence.active) this.ctx.notify(`Silence ${id} expired (its answer was lost on the way: the list shows it ended).`, "ok");
        else this.ctx.notify(`Silence ${id}: no answer from the gateway (${error.message})${silence ? "; the list shows it still active: Expire it again" : ""}.`);
        return;
      }
      this.ctx.notify(`Could not expire silence ${id}: ${error.message}`);
    }
    await this.loadSilences(false);
  }

  onEvent(event) {
    if (this.ctx.current() !== "notifications") return;
    if (event.aggregate_type === "alarm" || event.aggregate_type === "command" || event.aggregate_type === "campaign") this.refreshSoon();
  }
}
