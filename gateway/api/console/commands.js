// Commands of one device: the list, sending one (operator, admin), cancelling an open one,
// and live status: a command's end comes on the stream (command.finished); the steps before
// it (CLAIMED, SENT) have no event, so while one is open the list is read again every 2 s.
import { query } from "./api.js";
import { clear, el, throttle, timeEl } from "./util.js";

const OPEN = new Set(["PENDING", "CLAIMED", "SENT"]);
const POLL_MS = 2000;

export class CommandsView {
  constructor(ctx) {
    this.ctx = ctx;
    this.pick = document.getElementById("command-device");
    this.create = document.getElementById("command-create");
    this.body = document.querySelector("#command-table tbody");
    this.empty = document.getElementById("command-empty");
    this.device = null;
    this.items = [];
    this.poll = null;
    this.refreshSoon = throttle(() => this.load(), 200);
    this.pick.addEventListener("submit", (event) => {
      event.preventDefault();
      const device = this.pick.elements.device.value.trim();
      if (device) this.ctx.navigate(`#/commands/${encodeURIComponent(device)}`);
    });
    this.create.addEventListener("submit", (event) => {
      event.preventDefault();
      this.send();
    });
  }

  async show(device) {
    this.device = device || null;
    this.pick.elements.device.value = this.device || "";
    this.create.hidden = !this.device || !this.ctx.canAct();
    if (!this.device) {
      this.items = [];
      this.render();
      return;
    }
    await this.load();
  }

  refresh() { return this.load(); }

  hide() {
    clearTimeout(this.poll);
    this.poll = null;
  }

  async load() {
    if (!this.device) return;
    const device = this.device;
    let page;
    try {
      page = await this.ctx.api.get(`/devices/${encodeURIComponent(device)}/commands${query({ limit: 50 })}`);
    } catch (error) {
      this.ctx.notify(`Commands of ${device}: ${error.message}`);
      return;
    }
    if (device !== this.device) return;
    this.items = page.items;
    this.render();
    clearTimeout(this.poll);
    if (this.items.some((c) => OPEN.has(c.status)) && this.ctx.current() === "commands") {
      this.poll = setTimeout(() => this.load(), POLL_MS);
    }
  }

  render() {
    clear(this.body);
    for (const command of this.items) {
      const cancel = this.ctx.canAct() && OPEN.has(command.status)
        ? el("button", { type: "button", class: "secondary", text: "Cancel", "aria-label": `Cancel command ${command.id}`, onclick: () => this.cancel(command.id) })
        : null;
      this.body.append(el("tr", { dataset: { commandId: command.id } },
        el("td", { "data-label": "Id", class: "num", text: String(command.id) }),
        el("td", { "data-label": "Name", text: command.name }),
        el("td", { "data-label": "Status" }, el("span", { class: "status", text: command.status })),
        el("td", { "data-label": "Created" }, timeEl(command.created_at)),
        el("td", { "data-label": "By", text: command.created_by || "—" }),
        el("td", { "data-label": "Result", text: command.result ? `${command.result}${command.result_code !== null ? ` (${command.result_code})` : ""}` : "—" }),
        el("td", {}, cancel)));
    }
    this.empty.hidden = this.items.length > 0;
    this.empty.textContent = this.device ? `No commands for ${this.device} yet.` : "Choose a device to see its commands.";
  }

  async send() {
    const form = this.create.elements;
    let params;
    try {
      params = JSON.parse(form.params.value || "{}");
      if (params === null || typeof params !== "object" || Array.isArray(params)) throw new Error("not an object");
    } catch {
      this.ctx.notify("Params must be a JSON object, e.g. {\"level\": 3}.");
      form.params.focus();
      return;
    }
    try {
      const answer = await this.ctx.api.post(`/devices/${encodeURIComponent(this.device)}/commands`, {
        name: form.name.value.trim(), params, delivery: form.delivery.value,
      });
      this.ctx.notify(`Command ${answer.command.id} ${answer.created ? "created" : "already existed"} (${answer.command.status}).`, "ok");
    } catch (error) {
      this.ctx.notify(`Could not send: ${error.message}`);
    }
    await this.load();
  }

  async cancel(id) {
    try {
      await this.ctx.api.post(`/commands/${id}/cancel`);
      this.ctx.notify(`Command ${id} cancelled.`, "ok");
    } catch (error) {
      this.ctx.notify(`Could not cancel command ${id}: ${error.message}`);
    }
    await this.load();
  }

  onEvent(event) {
    if (event.aggregate_type === "command" && this.device && this.ctx.current() === "commands") this.refreshSoon();
  }
}
