// Dead letters (admin): what could not be ingested, why, how big; a letter's payload (hex and
// text); replay through the normal path — offered only where a replay can ever ingest it (the
// API's `replayable`: not a truncated, MALFORMED or BAD_DEVICE_ID letter) —, a replay that
// failed shown as a failure; and discard, after a confirmation (audited by the gateway).
import { query } from "./api.js";
import { append, bytes, clear, el, readings, timeEl } from "./util.js";

const PAGE = 50;
// Bytes per line of the hex dump: eight fit the detail pane beside the list.
const HEX_ROW = 8;
// The outcomes of a replay that ingested nothing (the API's `succeeded` says so too).
const FAILED = /^(still_invalid|truncated)/;

// No answer, or one from something in between that does not know what the gateway did.
function outcomeUnknown(error) {
  return error.status === 0 || error.status === 502 || error.status === 504;
}

// A hex dump: offset, HEX_ROW bytes in hex, the same bytes as ASCII (a dot for the rest).
function hexDump(hex) {
  const lines = [];
  for (let at = 0; at < hex.length; at += HEX_ROW * 2) {
    const chunk = hex.slice(at, at + HEX_ROW * 2);
    const pairs = chunk.match(/../g) || [];
    const ascii = pairs.map((p) => {
      const code = parseInt(p, 16);
      return code >= 0x20 && code < 0x7f ? String.fromCharCode(code) : ".";
    }).join("");
    lines.push(`${(at / 2).toString(16).padStart(8, "0")}  ${pairs.join(" ").padEnd(HEX_ROW * 3 - 1)}  ${ascii}`);
  }
  return lines.join("\n");
}

export class DeadLettersView {
  constructor(ctx) {
    this.ctx = ctx;
    this.reading = readings();
    this.detailReading = readings(); // the detail: only the letter opened last is shown
    this.form = document.getElementById("dead-letter-filters");
    this.body = document.querySelector("#dead-letter-table tbody");
    this.empty = document.getElementById("dead-letter-empty");
    this.more = document.getElementById("dead-letter-more");
    this.detail = document.getElementById("dead-letter-detail");
    this.items = [];
    this.next = null;
    this.selected = null;
    this.form.addEventListener("submit", (event) => {
      event.preventDefault();
      this.load(false);
    });
    this.more.addEventListener("click", () => this.load(true));
  }

  async show(id) {
    await this.load(false);
    if (id) await this.open(Number(id));
    else this.close();
  }

  close() {
    this.detailReading(); // an answer on its way for the letter closed is dropped
    this.selected = null;
    this.detail.hidden = true;
    this.render();
  }

  refresh() { return this.reload(); }

  async load(append) {
    const reason = new FormData(this.form).get("reason").trim();
    const current = this.reading();
    let page;
    try {
      page = await this.ctx.api.get(`/dead-letters${query({ reason, limit: PAGE, before: append ? this.next : null })}`);
    } catch (error) {
      if (current()) this.ctx.notify(`Dead letters: ${error.message}`);
      return;
    }
    if (!current()) return;
    this.items = append ? [...this.items, ...page.items] : page.items;
    this.next = page.next_before ?? null;
    this.render();
  }

  // The list read again after an action, down to the oldest letter shown (the pages "Older
  // dead letters" loaded included; keyset by id, so letters arriving meanwhile push none
  // out): it used to read the first page alone, and a letter replayed on the second page
  // vanished from under the operator with the rest of it.
  async reload() {
    if (this.items.length <= PAGE) return this.load(false);
    const reason = new FormData(this.form).get("reason").trim();
    const oldest = Math.min(...this.items.map((l) => l.id));
    const keptNext = this.next;
    const current = this.reading();
    const items = [];
    let next = keptNext;
    try {
      let before = null;
      for (;;) {
        const page = await this.ctx.api.get(`/dead-letters${query({ reason, limit: 500, before })}`);
        items.push(...page.items.filter((l) => l.id >= oldest));
        before = page.next_before ?? null;
        if (page.items.some((l) => l.id <= oldest)) break;
        if (before === null) { next = null; break; }
      }
    } catch (error) {
      if (current()) this.ctx.notify(`Dead letters: ${error.message}`);
      return;
    }
    if (!current()) return;
    this.items = items;
    this.next = next;
    this.render();
  }

  render() {
    clear(this.body);
    for (const letter of this.items) {
      const failed = letter.replay_outcome !== null && FAILED.test(letter.replay_outcome);
      const replayed = letter.replay_count
        ? `${failed ? "failed: " : ""}${letter.replay_outcome || "?"} (${letter.replay_count}×)`
        : "no";
      const actions = el("td", { class: "row-actions" },
        el("a", { href: `#/dead-letters/${letter.id}`, class: "button-link", text: "View", "aria-label": `View dead letter ${letter.id}` }),
        letter.replayable
          ? el("button", { type: "button", class: "secondary", text: "Replay", "aria-label": `Replay dead letter ${letter.id}`, onclick: () => this.replay(letter.id) })
          : el("span", { class: "hint not-replayable", title: letter.not_replayable_because || "", text: "cannot be replayed" }));
      this.body.append(el("tr", { dataset: { deadLetterId: letter.id }, class: [failed ? "failed" : "", letter.id === this.selected ? "selected" : ""].join(" ").trim() || null },
        el("td", { "data-label": "Id", class: "num", text: String(letter.id) }),
        el("td", { "data-label": "Received" }, timeEl(letter.received_at)),
        el("td", { "data-label": "Topic", text: letter.topic }),
        el("td", { "data-label": "Reason" }, el("strong", { text: letter.reason }), letter.detail ? el("div", { class: "hint", text: letter.detail }) : null),
        el("td", { "data-label": "Size", class: "num", text: letter.kept < letter.size ? `${bytes(letter.size)} (${bytes(letter.kept)} kept)` : bytes(letter.size) }),
        el("td", { "data-label": "Replayed", class: failed ? "replayed last-error" : "replayed", text: replayed }),
        actions));
    }
    this.empty.hidden = this.items.length > 0;
    this.more.hidden = this.next === null;
  }

  async open(id) {
    const current = this.detailReading();
    this.selected = id; // at once: as the alarms' and devices' details
    let letter;
    try {
      letter = await this.ctx.api.get(`/dead-letters/${id}`);
    } catch (error) {
      if (!current()) return;
      this.close();
      this.ctx.notify(error.status === 404 ? `Dead letter ${id} is gone (discarded, or pruned by retention).` : `Dead letter ${id}: ${error.message}`);
      return;
    }
    if (!current()) return;
    this.render();
    const d = clear(this.detail);
    d.hidden = false;
    d.dataset.deadLetterId = String(id);
    const failed = letter.replay_outcome !== null && FAILED.test(letter.replay_outcome);
    append(d,
      el("h3", { tabindex: "-1", text: `Dead letter ${letter.id}` }),
      el("dl", {},
        el("dt", { text: "Topic" }), el("dd", { text: letter.topic }),
        el("dt", { text: "Reason" }), el("dd", {}, el("strong", { text: letter.reason }), " ", letter.detail),
        el("dt", { text: "Received" }), el("dd", {}, timeEl(letter.received_at), ` on ${letter.node_id}`),
        el("dt", { text: "Seen" }), el("dd", {}, `${letter.seen_count}×, last `, timeEl(letter.last_seen_at)),
        el("dt", { text: "Size" }), el("dd", { text: letter.kept < letter.size ? `${bytes(letter.size)}, of which the first ${bytes(letter.kept)} were kept` : bytes(letter.size) }),
        el("dt", { text: "SHA-256" }), el("dd", { class: "mono", text: letter.payload_sha256 }),
        el("dt", { text: "Replayed" }), el("dd", { class: failed ? "replay-failed" : null },
          letter.replay_count ? `${letter.replay_count}×, last ` : "never",
          letter.replay_count ? timeEl(letter.replayed_at) : null,
          letter.replay_count ? `: ${failed ? "failed, " : ""}${letter.replay_outcome}` : null)),
      el("h3", { text: "Payload as text" }),
      letter.payload_text === null
        ? el("p", { class: "hint payload-text-none", text: "Not UTF-8 text: see the bytes below." })
        : el("pre", { class: "payload payload-text", text: letter.payload_text || "(empty)" }),
      el("h3", { text: "Payload bytes (hex)" }),
      el("pre", { class: "payload payload-hex", text: hexDump(letter.payload_hex) || "(empty)" }),
    );
    const actions = el("div", { class: "actions" });
    if (letter.replayable) {
      actions.append(el("button", { type: "button", text: "Replay", onclick: () => this.replay(id) }));
    } else {
      actions.append(el("p", { class: "hint not-replayable", text: `No replay: ${letter.not_replayable_because}.` }));
    }
    const discard = el("button", { type: "button", class: "secondary", text: "Discard…", onclick: () => {
      clear(confirmBox);
      append(confirmBox,
        el("p", { text: `Discard dead letter ${id}? It is deleted; the audit keeps what it was and that you discarded it.` }),
        el("button", { type: "button", class: "danger", text: "Discard dead letter", onclick: () => this.discard(id) }),
        " ",
        el("button", { type: "button", class: "secondary", text: "Keep it", onclick: () => { clear(confirmBox); discard.focus(); } }));
      confirmBox.querySelector("button").focus();
    } });
    const confirmBox = el("div", { class: "confirm", role: "group", "aria-label": "Confirm the discard" });
    actions.append(discard);
    append(d, actions, confirmBox);
    d.querySelector("h3").focus();
  }

  // What the gateway's record of the letter says now: the letter, null when it is gone, or
  // undefined when that cannot be read either.
  async reread(id) {
    try {
      return await this.ctx.api.get(`/dead-letters/${id}`);
    } catch (error) {
      return error.status === 404 ? null : undefined;
    }
  }

  async replay(id) {
    const shown = this.items.find((l) => l.id === id);
    const before = shown ? shown.replay_count : null;
    let answer;
    try {
      answer = await this.ctx.api.post(`/dead-letters/${id}/replay`);
    } catch (error) {
      if (!outcomeUnknown(error)) {
        this.ctx.notify(`Could not replay dead letter ${id}: ${error.message}`);
      } else {
        // No answer: the gateway may well have replayed it. Its record of the letter says.
        const letter = await this.reread(id);
        if (letter && before !== null && letter.replay_count > before) {
          const lost = " (its answer was lost on the way: the letter's record says so)";
          if (FAILED.test(letter.replay_outcome || "")) this.ctx.notify(`Replay of dead letter ${id} failed: ${letter.replay_outcome}. The letter stays${lost}.`);
          else this.ctx.notify(`Dead letter ${id} replayed: ${letter.replay_outcome}${lost}.`, "ok");
        } else {
          this.ctx.notify(`Dead letter ${id}: no answer from the gateway (${error.message}); its record shows no new replay yet. Look at its Replayed column before replaying it again.`);
        }
      }
      await this.reload();
      if (this.selected === id) await this.open(id);
      return;
    }
    if (answer.succeeded) this.ctx.notify(`Dead letter ${id} replayed: ${answer.outcome}.`, "ok");
    else this.ctx.notify(`Replay of dead letter ${id} failed: ${answer.outcome}. The letter stays.`);
    await this.reload();
    if (this.selected === id) await this.open(id);
  }

  async discard(id) {
    try {
      const answer = await this.ctx.api.delete(`/dead-letters/${id}`);
      this.ctx.notify(`Dead letter ${id} discarded by ${answer.discarded_by}.`, "ok");
    } catch (error) {
      if (outcomeUnknown(error)) {
        // No answer: the gateway may well have discarded it. Whether the letter is still there says.
        const letter = await this.reread(id);
        if (letter === null) {
          this.ctx.notify(`Dead letter ${id} discarded: it is gone (the answer was lost on the way; the audit says who discarded it).`, "ok");
        } else {
          this.ctx.notify(`Dead letter ${id}: no answer from the gateway (${error.message}); ${letter ? "the letter is still there: Discard it again" : "whether it was discarded is not known yet"}.`);
          if (letter && this.selected === id) { await this.reload(); await this.open(id); return; }
        }
      } else {
        const who = error.code === "ALREADY_DISCARDED" ? ` (${error.body.actor} did, first)` : "";
        this.ctx.notify(`Could not discard dead letter ${id}: ${error.message}${who}`);
      }
    }
    this.close();
    // The address follows without a hashchange (which would redraw and hide the notice).
    if (location.hash !== "#/dead-letters") history.replaceState(null, "", "#/dead-letters");
    await this.reload();
  }
}
