// Commands: the whole fleet's (newest first, by status) or one device's; sending one to a
// device (operator, admin), cancelling an open one, and live status: a command's end comes on
// the stream (command.finished); the steps before it (CLAIMED, SENT) have no event, so while
// one shown is open the list is read again every 2 s.
import { query } from "./api.js";
import { clear, el, readings, throttle, timeEl } from "./util.js";

const OPEN = new Set(["PENDING", "CLAIMED", "SENT"]);
const POLL_MS = 2000;
const PAGE = 50;
const LIMIT_MAX = 500; // the API's largest page

// A command whose answer never came (the connection cut, a proxy's 502/504, a node restarting
// after its COMMIT) may well have been created: the gateway knows, the page does not. Each
// send carries an idempotency key, and the same form sent again after such an answer carries
// the same key: the gateway answers with the command it created first (`created` false), and
// the device is not commanded twice. A key is dropped once an answer came (a new send of the
// same form is a new command, as asked) and never reused for another form (another device,
// name, params or delivery would get the first command back). Sent again while the first is
// still on its way (a slow answer, a second click), it carries the same key too.
let unanswered = null; // { signature, key } of the last send whose outcome is not known yet
// A send not answered by then (a link gone silent, a node that died with the request) is
// given up as unanswered, and said so, rather than waited on with no end.
const ANSWER_TIMEOUT_MS = 20000;

function newKey() {
  const bytes = new Uint8Array(16);
  crypto.getRandomValues(bytes);
  return `console-${Array.from(bytes, (b) => b.toString(16).padStart(2, "0")).join("")}`;
}

// No answer, or one from something in between that does not know what the gateway did.
function outcomeUnknown(error) {
  return error.status === 0 || error.status === 502 || error.status === 504;
}

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
  const body = { device_id: device, name: name.trim(), params: parsed, delivery };
  const signature = JSON.stringify(body);
  const key = unanswered && unanswered.signature === signature ? unanswered.key : newKey();
  // Unknown from now until answered: Send clicked again meanwhile (a slow answer) reuses it.
  unanswered = { signature, key };
  try {
    const answer = await ctx.api.post("/commands", { ...body, idempotency_key: key }, { timeoutMs: ANSWER_TIMEOUT_MS });
    if (unanswered && unanswered.key === key) unanswered = null;
    ctx.notify(`Command ${answer.command.id} to ${device} ${answer.created ? "created" : "already existed"} (${answer.command.status}).`, "ok");
    return answer;
  } catch (error) {
    // Refused or not, sending this form again reuses the key: nothing twice either way.
    if (unanswered === null || unanswered.signature === signature) unanswered = { signature, key };
    if (outcomeUnknown(error)) {
      ctx.notify(`“${body.name}” to ${device}: no answer from the gateway (${error.message}), so the command may have been created. Send it again as it is: the gateway recognises it and does not create it twice.`);
    } else {
      ctx.notify(`Could not send to ${device}: ${error.message}`);
    }
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
    this.more = document.getElementById("command-more");
    this.device = null;
    this.status = "";
    this.items = [];
    this.next = null; // `before` for the next older page; null when none is left
    this.listed = null; // the device and status the rows shown are of
    this.appending = false;
    this.poll = null;
    this.more.addEventListener("click", () => this.older());
    // An older page on its way is not dropped by a live update: the update waits for it.
    this.refreshSoon = throttle(() => (this.appending ? this.refreshSoon() : this.load()), 200);
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

  // The list read again from the newest: for the device and status shown, down to the oldest
  // row shown (the older pages loaded included: rows arrived meanwhile push none of them out),
  // or the first page for another device or status.
  async load() {
    const device = this.device;
    const status = this.status;
    const listed = `${device || ""}\n${status}`;
    const oldest = listed === this.listed && this.items.length > PAGE
      ? Math.min(...this.items.map((c) => c.id)) : null;
    const keptNext = this.next;
    const current = this.reading();
    const items = [];
    let next = null;
    try {
      let before = null;
      for (;;) {
        // One device's (native or Sparkplug) or the fleet's, of one status or all.
        const limit = oldest === null ? PAGE : Math.min(Math.max(PAGE, this.items.length - items.length + 10), LIMIT_MAX);
        const page = await this.ctx.api.get(`/commands${query({ limit, device: device || undefined, status: status || undefined, before })}`);
        if (oldest === null) { items.push(...page.items); next = page.next_before ?? null; break; }
        items.push(...page.items.filter((c) => c.id >= oldest));
        before = page.next_before ?? null;
        if (before === null || page.items.some((c) => c.id <= oldest)) { next = before === null && !page.items.some((c) => c.id < oldest) ? null : keptNext; break; }
      }
    } catch (error) {
      if (current()) this.ctx.notify(`Commands${device ? ` of ${device}` : ""}: ${error.message}`);
      return;
    }
    if (!current()) return;
    this.items = items;
    this.next = next;
    this.listed = listed;
    this.render();
  }

  // The next older page, after the rows shown (keyset: by id, so rows that arrive meanwhile
  // neither shift it nor repeat in it).
  async older() {
    if (this.next === null || this.appending) return;
    const device = this.device;
    const status = this.status;
    const current = this.reading();
    this.appending = true;
    let page;
    try {
      page = await this.ctx.api.get(`/commands${query({ limit: PAGE, device: device || undefined, status: status || undefined, before: this.next })}`);
    } catch (error) {
      if (current()) this.ctx.notify(`Commands${device ? ` of ${device}` : ""}: ${error.message}`);
      return;
    } finally {
      this.appending = false;
    }
    if (!current()) return;
    const shown = new Set(this.items.map((c) => c.id));
    this.items = [...this.items, ...page.items.filter((c) => !shown.has(c.id))];
    this.next = page.next_before ?? null;
    this.render();
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
    this.more.hidden = this.next === null;
    // While one shown is open, the list is read again (an older page being loaded: after it).
    clearTimeout(this.poll);
    this.poll = null;
    if (this.items.some((c) => OPEN.has(c.status)) && this.ctx.current() === "commands") {
      const tick = () => { if (this.appending) this.poll = setTimeout(tick, POLL_MS); else this.load(); };
      this.poll = setTimeout(tick, POLL_MS);
    }
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
      if (outcomeUnknown(error)) {
        // No answer: the gateway may well have cancelled it. The list read again says.
        await this.load();
        const command = this.items.find((c) => c.id === id);
        if (command && command.status === "CANCELLED") {
          this.ctx.notify(`Command ${id} cancelled (its answer was lost on the way: the list shows it cancelled).`, "ok");
        } else {
          const now = command ? `; the list shows it ${command.status}${OPEN.has(command.status) ? ": Cancel it again" : ""}` : "";
          this.ctx.notify(`Command ${id}: no answer from the gateway (${error.message})${now}.`);
        }
        return;
      }
      this.ctx.notify(`Could not cancel command ${id}: ${error.message}`);
    }
    await this.load();
  }

  onEvent(event) {
    if (event.aggregate_type === "command" && this.ctx.current() === "commands") this.refreshSoon();
  }
}
