// Campaigns: one command for many devices. GET /campaigns lists them without counts, so the
// page reads each visible campaign's detail (GET /campaigns/{id}: total and counts per command
// status). Live: campaign.* events, and command.finished events of a campaign's command, read
// the list again, throttled (a campaign of a thousand devices finishing costs a read a second).
import { query } from "./api.js";
import { clear, el, throttle, timeEl } from "./util.js";

const PAGE = 20;
// The order a command moves in; the counts are shown in it.
const COMMAND_STATUSES = ["PENDING", "CLAIMED", "SENT", "ACKED", "FAILED", "TIMEOUT", "CANCELLED"];

export class CampaignsView {
  constructor(ctx) {
    this.ctx = ctx;
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
  }

  show() { return this.load(false); }

  refresh() { return this.reload(); }

  async load(append) {
    const status = new FormData(this.form).get("status");
    let page;
    try {
      page = await this.ctx.api.get(`/campaigns${query({ status, limit: PAGE, before: append ? this.next : null })}`);
    } catch (error) {
      this.ctx.notify(`Campaigns: ${error.message}`);
      return;
    }
    const detailed = await this.details(page.items);
    if (detailed === null) return;
    this.items = append ? [...this.items, ...detailed] : detailed;
    this.next = page.next_before ?? null;
    this.render();
  }

  // Every page shown so far, read again (the list's filter, the same number of campaigns).
  async reload() {
    const status = new FormData(this.form).get("status");
    const limit = Math.max(PAGE, this.items.length);
    let page;
    try {
      page = await this.ctx.api.get(`/campaigns${query({ status, limit: Math.min(limit, 500) })}`);
    } catch (error) {
      this.ctx.notify(`Campaigns: ${error.message}`);
      return;
    }
    const detailed = await this.details(page.items);
    if (detailed === null) return;
    this.items = detailed;
    this.next = page.next_before ?? null;
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
