// Campaigns: shown only when the gateway answers GET /campaigns (an API still to come); a
// campaign's progress is its commands counted per status, as the API gives them.
import { clear, el } from "./util.js";

export async function campaignsAvailable(api) {
  try {
    await api.get("/campaigns");
    return true;
  } catch {
    return false;
  }
}

export class CampaignsView {
  constructor(ctx) {
    this.ctx = ctx;
    this.body = document.querySelector("#campaign-table tbody");
  }

  async show() {
    let answer;
    try {
      answer = await this.ctx.api.get("/campaigns");
    } catch (error) {
      this.ctx.notify(`Campaigns: ${error.message}`);
      return;
    }
    const items = answer.campaigns || answer.items || [];
    clear(this.body);
    for (const campaign of items) {
      const counts = campaign.counts || campaign.progress || {};
      this.body.append(el("tr", {},
        el("td", { "data-label": "Campaign", text: campaign.name || `#${campaign.id}` }),
        el("td", { "data-label": "Progress", text: Object.entries(counts).map(([status, n]) => `${status} ${n}`).join(" · ") || "—" })));
    }
  }

  refresh() { return this.show(); }

  onEvent(event) {
    if (event.aggregate_type === "campaign" && this.ctx.current() === "campaigns") this.show();
  }
}
