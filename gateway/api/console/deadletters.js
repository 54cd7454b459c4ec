// Dead letters (admin): what could not be ingested, why, how big; replay through the normal path.
import { query } from "./api.js";
import { bytes, clear, el, timeEl } from "./util.js";

const PAGE = 50;

export class DeadLettersView {
  constructor(ctx) {
    this.ctx = ctx;
    this.form = document.getElementById("dead-letter-filters");
    this.body = document.querySelector("#dead-letter-table tbody");
    this.empty = document.getElementById("dead-letter-empty");
    this.more = document.getElementById("dead-letter-more");
    this.items = [];
    this.next = null;
    this.form.addEventListener("submit", (event) => {
      event.preventDefault();
      this.load(false);
    });
    this.more.addEventListener("click", () => this.load(true));
  }

  show() { return this.load(false); }

  refresh() { return this.load(false); }

  async load(append) {
    const reason = new FormData(this.form).get("reason").trim();
    let page;
    try {
      page = await this.ctx.api.get(`/dead-letters${query({ reason, limit: PAGE, before: append ? this.next : null })}`);
    } catch (error) {
      this.ctx.notify(`Dead letters: ${error.message}`);
      return;
    }
    this.items = append ? [...this.items, ...page.dead_letters] : page.dead_letters;
    this.next = page.next_before ?? null;
    this.render();
  }

  render() {
    clear(this.body);
    for (const letter of this.items) {
      const replayed = letter.replay_count
        ? `${letter.replay_outcome || "?"} (${letter.replay_count}×)`
        : "no";
      this.body.append(el("tr", { dataset: { deadLetterId: letter.id } },
        el("td", { "data-label": "Id", class: "num", text: String(letter.id) }),
        el("td", { "data-label": "Received" }, timeEl(letter.received_at)),
        el("td", { "data-label": "Topic", text: letter.topic }),
        el("td", { "data-label": "Reason" }, el("strong", { text: letter.reason }), letter.detail ? el("div", { class: "hint", text: letter.detail }) : null),
        el("td", { "data-label": "Size", class: "num", text: bytes(letter.size) }),
        el("td", { "data-label": "Replayed", class: "replayed", text: replayed }),
        el("td", {}, el("button", { type: "button", class: "secondary", text: "Replay", "aria-label": `Replay dead letter ${letter.id}`, onclick: () => this.replay(letter.id) }))));
    }
    this.empty.hidden = this.items.length > 0;
    this.more.hidden = this.next === null;
  }

  async replay(id) {
    try {
      const answer = await this.ctx.api.post(`/dead-letters/${id}/replay`);
      this.ctx.notify(`Dead letter ${id} replayed: ${answer.outcome}.`, "ok");
    } catch (error) {
      this.ctx.notify(`Could not replay dead letter ${id}: ${error.message}`);
    }
    await this.load(false);
  }
}
