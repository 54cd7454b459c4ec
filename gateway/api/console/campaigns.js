// Campaigns: one command for many devices. GET /campaigns lists them without counts, so the
// page reads each visible campaign's detail (GET /campaigns/{id}: total and counts per command
// status). Live: campaign.* events, and command.finished events of a campaign's command, read
// the list again, throttled (a campaign of a thousand devices finishing costs a read a second).
// Operators start one with the form: targets by selector with a live count of the devices it
// picks (GET /campaigns/targets), rollout and abort criteria, then a confirmation that says how
// many devices will be commanded before anything is created.
import { query } from "./api.js";
import { clear, el, readings, throttle, timeEl } from "./util.js";

const PAGE = 20;
const COUNT_DELAY_MS = 300;
// A start not answered by then (a link gone silent, a node that died with the request) is
// given up as unanswered: Start again is offered, with the same key, rather than a button
// disabled for as long as the browser waits (with no end, on a link that went silent).
const ANSWER_TIMEOUT_MS = 20000;

// A selector as typed: comma-separated, spaces around the items dropped.
function selectorOf(text) {
  return text.split(",").map((s) => s.trim()).filter(Boolean).join(",");
}

function newKey() {
  const bytes = new Uint8Array(16);
  crypto.getRandomValues(bytes);
  return `console-${Array.from(bytes, (b) => b.toString(16).padStart(2, "0")).join("")}`;
}

function whole(text) {
  if (text === "") return null;
  const value = Number(text);
  return Number.isInteger(value) && value >= 1 ? value : NaN;
}
// The order a command moves in; the counts are shown in it.
const COMMAND_STATUSES = ["PENDING", "CLAIMED", "SENT", "ACKED", "FAILED", "TIMEOUT", "CANCELLED"];

export class CampaignsView {
  constructor(ctx) {
    this.ctx = ctx;
    this.reading = readings(); // load and reload read the same list
    this.form = document.getElementById("campaign-filters");
    this.body = document.querySelector("#campaign-table tbody");
    this.empty = document.getElementById("campaign-empty");
    this.more = document.getElementById("campaign-more");
    this.items = [];
    this.next = null;
    this.known = new Set();
    this.form.addEventListener("submit", (event) => {
      event.preventDefault();
      this.load(false);
    });
    this.more.addEventListener("click", () => this.load(true));
    this.refreshSoon = throttle(() => this.reload(), 1000);
    this.create = document.getElementById("campaign-create");
    this.countOut = document.getElementById("campaign-target-count");
    this.confirm = document.getElementById("campaign-confirm");
    this.countTimer = null;
    this.countReading = readings(); // the live count: only the newest selector's answer
    this.pending = null;
    this.unanswered = null; // { signature, key } of a start whose answer never came
    this.create.elements.selector.addEventListener("input", () => {
      clearTimeout(this.countTimer);
      this.countTimer = setTimeout(() => this.count(), COUNT_DELAY_MS);
    });
    this.create.addEventListener("submit", (event) => {
      event.preventDefault();
      this.review();
    });
    // Any change to the form after a review makes that review stale.
    this.create.addEventListener("input", () => { if (!this.confirm.hidden) this.back(false); });
    document.getElementById("campaign-start").addEventListener("click", () => this.start());
    document.getElementById("campaign-back").addEventListener("click", () => this.back(true));
  }

  // The live count: what the selector picks now, as a campaign started now would.
  async count() {
    const selector = selectorOf(this.create.elements.selector.value);
    const current = this.countReading();
    if (!selector) {
      this.countOut.textContent = "Type a selector: device ids and globs, comma-separated.";
      this.countOut.dataset.count = "";
      return null;
    }
    let answer;
    try {
      answer = await this.ctx.api.get(`/campaigns/targets${query({ selector })}`);
    } catch (error) {
      if (!current()) return null;
      this.countOut.textContent = error.status === 400 ? `Not a selector: ${error.message}` : `Cannot count: ${error.message}`;
      this.countOut.dataset.count = "";
      return null;
    }
    if (!current()) return null;
    const shown = answer.sample.join(", ") + (answer.count > answer.sample.length ? ", …" : "");
    this.countOut.dataset.count = String(answer.count);
    this.countOut.textContent = answer.count === 0
      ? "No device that takes commands matches."
      : `${answer.count} device${answer.count === 1 ? "" : "s"} match: ${shown}`;
    return answer;
  }

  // The form checked and the targets counted again: the confirmation, nothing created yet.
  async review() {
    const f = this.create.elements;
    const name = f.name.value.trim();
    const selector = selectorOf(f.selector.value);
    if (!name) { this.ctx.notify("A campaign needs a command name."); f.name.focus(); return; }
    let params;
    try {
      params = JSON.parse(f.params.value || "{}");
      if (params === null || typeof params !== "object" || Array.isArray(params)) throw new Error("not an object");
    } catch {
      this.ctx.notify("Params must be a JSON object, e.g. {\"level\": 3}.");
      f.params.focus();
      return;
    }
    if (!selector) { this.ctx.notify("A campaign needs targets: a selector such as pump-*."); f.selector.focus(); return; }
    const perMinute = whole(f.per_minute.value.trim());
    if (Number.isNaN(perMinute)) { this.ctx.notify("Rollout: a whole number of commands per minute, 1 or more."); f.per_minute.focus(); return; }
    const percent = f.failure_ratio.value.trim() === "" ? null : Number(f.failure_ratio.value);
    const minFinished = whole(f.min_finished.value.trim());
    if ((percent === null) !== (minFinished === null)) {
      this.ctx.notify("Abort criteria: give both the failed share and how many must be finished first, or neither.");
      (percent === null ? f.failure_ratio : f.min_finished).focus();
      return;
    }
    if (percent !== null && (!(percent > 0 && percent <= 100) || Number.isNaN(minFinished))) {
      this.ctx.notify("Abort criteria: a share above 0 and at most 100 %, and a whole number finished.");
      f.failure_ratio.focus();
      return;
    }
    // The live count still waiting to run would make this one stale (and the review silent).
    clearTimeout(this.countTimer);
    const counted = await this.count();
    if (counted === null) { f.selector.focus(); return; }
    if (counted.count === 0) {
      this.ctx.notify("The selector picks no device that takes commands: nothing to start.");
      f.selector.focus();
      return;
    }
    const body = { name, params, delivery: f.delivery.value, targets: { selector: selector.split(",") } };
    if (perMinute !== null) body.rollout = { per_minute: perMinute };
    if (percent !== null) body.abort = { failure_ratio: percent / 100, min_finished: minFinished };
    // The same campaign reviewed again after a start whose answer never came: the same key,
    // so that starting it again cannot start it twice.
    const signature = JSON.stringify(body);
    body.idempotency_key = this.unanswered && this.unanswered.signature === signature ? this.unanswered.key : newKey();
    this.pending = { body, count: counted.count };
    const n = counted.count;
    document.getElementById("campaign-confirm-text").textContent =
      `Send “${name}” to ${n} device${n === 1 ? "" : "s"}?`;
    document.getElementById("campaign-confirm-text").dataset.count = String(n);
    const parts = [
      `Targets: ${selector} (${counted.sample.join(", ")}${n > counted.sample.length ? ", …" : ""})`,
      `params ${JSON.stringify(params)}`,
      `${body.delivery} delivery`,
      perMinute !== null ? `at most ${perMinute} per minute` : "no rollout limit",
      percent !== null ? `aborted once ${minFinished} are finished with ${percent} % or more failed` : "no abort criteria",
    ];
    document.getElementById("campaign-confirm-detail").textContent = `${parts.join("; ")}. Devices that appear or are unbound before you start change the count.`;
    this.confirm.hidden = false;
    document.getElementById("campaign-confirm-title").focus();
  }

  back(focus) {
    this.confirm.hidden = true;
    this.pending = null;
    if (focus) this.create.elements.name.focus();
  }

  async start() {
    if (!this.pending) return;
    const { body, count } = this.pending;
    const button = document.getElementById("campaign-start");
    button.disabled = true;
    const { idempotency_key: key, ...asked } = body;
    // Unknown from now until answered: the same campaign reviewed again meanwhile (Back while
    // the answer is slow) keeps this key.
    this.unanswered = { signature: JSON.stringify(asked), key };
    let answer;
    try {
      answer = await this.ctx.api.post("/campaigns", body, { timeoutMs: ANSWER_TIMEOUT_MS });
    } catch (error) {
      button.disabled = false;
      if (error.status === 0 || error.status === 502 || error.status === 504) {
        // No answer, or one from something in between: the gateway may well have started it.
        this.ctx.notify(`“${body.name}”: no answer from the gateway (${error.message}), so the campaign may have started. Start campaign again as it is: the gateway recognises it and does not start it twice.`);
        return;
      }
      const detail = error.code === "NO_TARGETS" ? " (the selector picks no device now)" : "";
      this.ctx.notify(`Could not start the campaign: ${error.message}${detail}`);
      return;
    }
    button.disabled = false;
    if (this.unanswered && this.unanswered.key === key) this.unanswered = null;
    const campaign = answer.campaign;
    const differs = campaign.total !== count ? ` (${count} matched when you reviewed it)` : "";
    const what = answer.created ? "started" : "already started by the earlier Start, not started again";
    this.ctx.notify(`Campaign #${campaign.id} “${campaign.name}” ${what}: ${campaign.total} command${campaign.total === 1 ? "" : "s"}${differs}.`, "ok");
    this.confirm.hidden = true;
    this.pending = null;
    this.create.reset();
    this.countOut.textContent = "Type a selector: device ids and globs, comma-separated.";
    await this.reload();
  }

  show() { return this.load(false); }

  refresh() { return this.reload(); }

  async load(append) {
    const status = new FormData(this.form).get("status");
    const current = this.reading();
    let page;
    try {
      page = await this.ctx.api.get(`/campaigns${query({ status, limit: PAGE, before: append ? this.next : null })}`);
    } catch (error) {
      if (current()) this.ctx.notify(`Campaigns: ${error.message}`);
      return;
    }
    const detailed = await this.details(page.items);
    if (detailed === null || !current()) return;
    this.items = append ? [...this.items, ...detailed] : detailed;
    this.next = page.next_before ?? null;
    this.render();
  }

  // Every page shown so far, read again (the list's filter, the same number of campaigns).
  // Down to the oldest campaign shown (keyset by id): a new campaign used to push the oldest
  // one shown out of the list, from under the operator, once Older campaigns had loaded more.
  async reload() {
    const status = new FormData(this.form).get("status");
    const oldest = this.items.length > PAGE ? Math.min(...this.items.map((c) => c.id)) : null;
    const current = this.reading();
    const items = [];
    let next = null;
    try {
      let before = null;
      for (;;) {
        const page = await this.ctx.api.get(`/campaigns${query({ status, limit: oldest === null ? PAGE : 500, before })}`);
        if (oldest === null) { items.push(...page.items); next = page.next_before ?? null; break; }
        items.push(...page.items.filter((c) => c.id >= oldest));
        before = page.next_before ?? null;
        if (page.items.some((c) => c.id <= oldest)) { next = this.next; break; }
        if (before === null) break;
      }
    } catch (error) {
      if (current()) this.ctx.notify(`Campaigns: ${error.message}`);
      return;
    }
    const detailed = await this.details(items);
    if (detailed === null || !current()) return;
    this.items = detailed;
    this.next = next;
    this.render();
  }

  // The detail of each listed campaign, read in parallel: its total and counts.
  async details(items) {
    try {
      return await Promise.all(items.map((c) => this.ctx.api.get(`/campaigns/${c.id}`)));
    } catch (error) {
      this.ctx.notify(`Campaigns: ${error.message}`);
      return null;
    }
  }

  render() {
    clear(this.body);
    this.known = new Set(this.items.map((c) => c.id));
    for (const campaign of this.items) {
      const counts = campaign.counts || {};
      const finished = ["ACKED", "FAILED", "TIMEOUT", "CANCELLED"].reduce((n, s) => n + (counts[s] || 0), 0);
      const progress = el("ul", { class: "counts", "aria-label": `Commands of campaign ${campaign.id} per status` },
        COMMAND_STATUSES.filter((s) => counts[s]).map((s) =>
          el("li", { class: `count count-${s}`, dataset: { status: s } },
            el("span", { class: "status", text: s }), " ", el("span", { class: "num", text: String(counts[s]) }))));
      const cancel = this.ctx.canAct() && campaign.status === "RUNNING"
        ? el("button", { type: "button", class: "secondary", text: "Cancel", "aria-label": `Cancel campaign ${campaign.id}`, onclick: () => this.cancel(campaign.id) })
        : null;
      const target = campaign.target_devices
        ? `${campaign.target_devices.length} device(s)`
        : `selector ${(campaign.target_selector || []).join(", ")}`;
      this.body.append(el("tr", { dataset: { campaignId: campaign.id } },
        el("td", { "data-label": "Campaign" },
          el("strong", { text: `#${campaign.id} ${campaign.name}` }),
          el("div", { class: "hint", text: `${target}, by ${campaign.created_by}` }),
          el("div", { class: "hint" }, timeEl(campaign.created_at))),
        el("td", { "data-label": "Status" },
          el("span", { class: `status campaign-${campaign.status}`, text: campaign.status }),
          campaign.status_reason ? el("div", { class: "hint", text: campaign.status_reason }) : null),
        el("td", { "data-label": "Progress" },
          el("div", { class: "done num", text: `${finished} / ${campaign.total} finished` }), progress),
        el("td", {}, cancel)));
    }
    this.empty.hidden = this.items.length > 0;
    this.more.hidden = this.next === null;
  }

  async cancel(id) {
    try {
      await this.ctx.api.post(`/campaigns/${id}/cancel`);
      this.ctx.notify(`Campaign ${id} cancelled.`, "ok");
    } catch (error) {
      if (error.status === 0 || error.status === 502 || error.status === 504) {
        // No answer: the gateway may well have cancelled it. The list read again says.
        await this.reload();
        const campaign = this.items.find((c) => c.id === id);
        if (campaign && campaign.status === "CANCELLED") {
          this.ctx.notify(`Campaign ${id} cancelled (its answer was lost on the way: the list shows it cancelled).`, "ok");
        } else {
          const now = campaign ? `; the list shows it ${campaign.status}${campaign.status === "RUNNING" ? ": Cancel it again" : ""}` : "";
          this.ctx.notify(`Campaign ${id}: no answer from the gateway (${error.message})${now}.`);
        }
        return;
      }
      this.ctx.notify(`Could not cancel campaign ${id}: ${error.message}`);
    }
    await this.reload();
  }

  onEvent(event) {
    if (this.ctx.current() !== "campaigns") return;
    if (event.aggregate_type === "campaign") this.refreshSoon();
    else if (event.aggregate_type === "command") {
      const command = event.payload && event.payload.command;
      if (command && command.campaign_id != null) this.refreshSoon();
    }
  }
}
