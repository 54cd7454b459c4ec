// Commands: the whole fleet's (newest first, by status) or one device's; sending one to a
// device (operator, admin), cancelling an open one, and live status: a command's end comes on
// the stream (command.finished); the steps before it (CLAIMED, SENT) have no event, so while
// one shown is open the list is read again every 2 s.
import { query } from "./api.js";
import { clear, el, readings, throttle, timeEl } from "./util.js";

const OPEN = new Set(["PENDING", "CLAIMED", "SENT"]);
const POLL_MS = 2000;

// POST /commands from a form's values (params as JSON text), the device in the body: a native
// id or a Sparkplug one (`{group}/{node}/{device}`, which no path can carry); the answer, or
// null once the error is shown. The commands view and a device's page both send through this.
export async function sendCommand(ctx, device, { name, params, delivery }, paramsField = null) {
  let parsed;
  try {
    parsed = JSON.parse(params || "{}");
    if (parsed === null || typeof parsed !== "object" || Array.isArray(parsed)) throw new Error("not an object");
  } catch {
    ctx.notify("Params must be a JSON object, e.g. {\"level\": 3}.");
    if (paramsField) paramsField.focus();
    return null;
  }
  try {
    const answer = await ctx.api.post("/commands", {
      device_id: device, name: name.trim(), params: parsed, delivery,
    });
    ctx.notify(`Command ${answer.command.id} to ${device} ${answer.created ? "created" : "already existed"} (${answer.command.status}).`, "ok");
    return answer;
  } catch (error) {
    ctx.notify(`Could not send to ${device}: ${error.message}`);
    return null;
  }
}

export class CommandsView {
  constructor(ctx) {
    this.ctx = ctx;
    this.reading = readings(); // only the newest device's and status's answer is shown
    this.pick = document.getElementById("command-device");
    this.create = document.getElementById("command-create");
    this.body = document.querySelector("#command-table tbody");
    this.empty = document.getElementById("command-empty");
    this.device = null;
    this.status = "";
    this.items = [];
    this.poll = null;
    this.refreshSoon = throttle(() => this.load(), 200);
    this.pick.addEventListener("submit", (event) => {
      event.preventDefault();
      this.status = this.pick.elements.status.value;
      const device = this.pick.elements.device.value.trim();
      const hash = device ? `#/commands/${encodeURIComponent(device)}` : "#/commands";
      // The same view again (only the status changed): no hash change to wait for.
      if ((device || null) === this.device) this.load();
      else this.ctx.navigate(hash);
    });
    this.create.addEventListener("submit", (event) => {
      event.preventDefault();
      this.send();
    });
  }

  async show(device) {
    this.device = device || null;
    this.pick.elements.device.value = this.device || "";
    // The form is there for operators whatever the list shows: the device is one of its fields,
    // filled in from the device being shown.
    this.create.hidden = !this.ctx.canAct();
    if (this.device) this.create.elements.device.value = this.device;
    await this.load();
  }

  refresh() { return this.load(); }

  hide() {
    clearTimeout(this.poll);
    this.poll = null;
  }

  async load() {
    const device = this.device;
    const status = this.status;
    // One device's (native or Sparkplug) or the fleet's, of one status or all.
    const path = `/commands${query({ limit: 50, device: device || undefined, status: status || undefined })}`;
    const current = this.reading();
    let page;
    try {
      page = await this.ctx.api.get(path);
    } catch (error) {
      if (current()) this.ctx.notify(`Commands${device ? ` of ${device}` : ""}: ${error.message}`);
      return;
    }
    if (!current()) return;
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
        el("td", { "data-label": "Device" }, el("a", { href: `#/commands/${encodeURIComponent(command.device_id)}`, text: command.device_id })),
        el("td", { "data-label": "Name", text: command.name }),
        el("td", { "data-label": "Status" }, el("span", { class: "status", text: command.status })),
        el("td", { "data-label": "Created" }, timeEl(command.created_at)),
        el("td", { "data-label": "By", text: command.created_by || "—" }),
        el("td", { "data-label": "Result", text: command.result ? `${command.result}${command.result_code !== null ? ` (${command.result_code})` : ""}` : "—" }),
        el("td", {}, cancel)));
    }
    this.empty.hidden = this.items.length > 0;
    const which = this.status ? `${this.status} commands` : "commands";
    this.empty.textContent = this.device ? `No ${which} for ${this.device}.` : `No ${which} yet.`;
  }

  async send() {
    const form = this.create.elements;
    const device = form.device.value.trim();
    const answer = await sendCommand(this.ctx, device, {
      name: form.name.value, params: form.params.value, delivery: form.delivery.value,
    }, form.params);
    // Sent to another device than the list shows: show that device's commands (the address
    // follows without a hashchange, which would redraw and hide the notice).
    if (answer && device !== this.device) {
      history.replaceState(null, "", `#/commands/${encodeURIComponent(device)}`);
      this.device = device;
      this.pick.elements.device.value = device;
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
    if (event.aggregate_type === "command" && this.ctx.current() === "commands") this.refreshSoon();
  }
}
