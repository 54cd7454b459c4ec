// The live stream: Server-Sent Events from GET /stream, opened with a single-use ticket
// (the long-lived token never goes in a URL), read with fetch() and parsed here.
//
// A ticket is good for one connection: on any end of the stream the page opens a new one with
// a fresh ticket and the id of the last event it saw, from which the gateway resumes with no
// gap and no duplicate. Retries back off from half a second to five.
//
// Why not EventSource: it hides the gateway's keep-alive comments and the answer's status. A
// link that died without a word (no FIN, no reset: a firewall or NAT that lost the connection,
// a cable pulled between two switches) brings nothing, and EventSource would stay "open" for
// minutes (the browser's TCP keep-alive) or for good (a box on the way still answers it),
// the page saying "live" while alarms go unseen. Here every byte read, comments included,
// proves the link: a stream that brings nothing for STALL_MS (the gateway writes a comment
// every 15 s) is cut and resumed. A ticket that does not come within TICKET_TIMEOUT_MS is
// given up and asked again.
//
// A resume the gateway refuses for good, 400 CURSOR_AHEAD (the database it came back to has no
// event as new as the one the page saw: a failover to a standby that was behind, a restore),
// would fail the same way forever: the page drops the cursor (onReset: every view is read
// again) and starts anew.

import { apiUrl } from "./api.js";

export const STALL_MS = 35_000;
export const TICKET_TIMEOUT_MS = 10_000;

// The outbox's event types: the only events handed on (as EventSource hands a named event
// only to listeners of that name).
export const EVENT_TYPES = [
  "alarm.created", "alarm.superseded", "alarm.cleared", "alarm.status_changed",
  "alarm.woken", "alarm.escalated", "alarm.reminder",
  "command.finished",
  "campaign.created", "campaign.completed", "campaign.aborted", "campaign.cancelled",
  "ai.summary_succeeded", "ai.summary_failed",
  "shelf.started", "shelf.ended", "device.out_of_service", "device.in_service",
  "message",
];

export class LiveStream {
  constructor(api, { onEvent, onState, onResumed, onReset }) {
    this.api = api;
    this.onEvent = onEvent;
    this.onState = onState;
    this.onResumed = onResumed || (() => {});
    this.onReset = onReset || this.onResumed;
    this.lastEventId = null;
    this.controller = null; // the connection's, to cut it
    this.timer = null;
    this.stallTimer = null;
    this.delay = 500;
    this.stopped = false;
    this.everOpened = false;
    this.resetting = false;
  }

  start() {
    this.stopped = false;
    this.connect();
  }

  stop() {
    this.stopped = true;
    clearTimeout(this.timer);
    clearTimeout(this.stallTimer);
    if (this.controller) this.controller.abort();
    this.controller = null;
    this.onState("off", "not live");
  }

  async connect() {
    if (this.stopped) return;
    this.onState(this.everOpened ? "reconnecting" : "connecting", this.everOpened ? "reconnecting…" : "connecting…");
    let ticket;
    try {
      ticket = (await this.api.post("/stream/tickets", {}, { timeoutMs: TICKET_TIMEOUT_MS })).ticket;
    } catch (error) {
      if (error.status === 401) return; // signed out by the API wrapper
      this.retry();
      return;
    }
    if (this.stopped) return;
    const params = new URLSearchParams({ ticket });
    const cursor = this.lastEventId;
    if (cursor) params.set("last_event_id", cursor);
    const controller = new AbortController();
    this.controller = controller;
    // Nothing read for STALL_MS, from the request on: the link is dead, whatever TCP says.
    const alive = () => {
      clearTimeout(this.stallTimer);
      this.stallTimer = setTimeout(() => controller.abort(), STALL_MS);
    };
    alive();
    try {
      const response = await fetch(apiUrl(`/stream?${params}`), {
        headers: { Accept: "text/event-stream" },
        cache: "no-store",
        signal: controller.signal,
      });
      if (!response.ok) {
        let body = null;
        try { body = await response.json(); } catch { body = null; }
        if (this.controller === controller && response.status === 400 && body && body.error === "CURSOR_AHEAD"
            && cursor && cursor === this.lastEventId) {
          this.lastEventId = null;
          this.resetting = true;
        }
      } else {
        if (this.controller !== controller) return;
        const resumed = this.everOpened;
        this.everOpened = true;
        this.delay = 500;
        this.onState("live", "live");
        if (this.resetting) {
          this.resetting = false;
          this.onReset();
        } else if (resumed) this.onResumed();
        await this.read(response, controller, alive);
      }
    } catch {
      // Cut: by the gateway, the network, or the stall timer.
    }
    if (this.controller !== controller) return; // stopped, or superseded
    clearTimeout(this.stallTimer);
    controller.abort();
    this.controller = null;
    this.retry();
  }

  // The stream's events as EventSource parses them (id, event, data lines; comments; a blank
  // line ends an event), each named one of EVENT_TYPES handed on; every chunk read is a sign
  // of life. Returns when the stream ends.
  async read(response, controller, alive) {
    const reader = response.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    let type = "";
    let data = [];
    let id = null; // as EventSource's last event id: kept until the next id line
    for (;;) {
      const { value, done } = await reader.read();
      if (done || this.controller !== controller) return;
      alive();
      buffer += decoder.decode(value, { stream: true });
      let end;
      while ((end = buffer.indexOf("\n")) >= 0) {
        if (this.controller !== controller) return; // stopped by what an event did
        const line = buffer.slice(0, end).replace(/\r$/, "");
        buffer = buffer.slice(end + 1);
        if (line === "") {
          if (data.length) this.dispatch(type || "message", data.join("\n"), id);
          type = "";
          data = [];
          continue;
        }
        if (line.startsWith(":")) continue;
        const colon = line.indexOf(":");
        const name = colon < 0 ? line : line.slice(0, colon);
        const text = colon < 0 ? "" : line.slice(colon + 1).replace(/^ /, "");
        if (name === "data") data.push(text);
        else if (name === "event") type = text;
        else if (name === "id" && !text.includes("\0")) id = text;
      }
    }
  }

  dispatch(type, data, id) {
    if (!EVENT_TYPES.includes(type)) return;
    if (id) this.lastEventId = id;
    let event;
    try { event = JSON.parse(data); } catch { return; }
    // A view's failure is the page's error (reported as such), not the stream's end.
    queueMicrotask(() => this.onEvent(event));
  }

  retry() {
    if (this.stopped) return;
    this.onState("reconnecting", "reconnecting…");
    clearTimeout(this.timer);
    this.timer = setTimeout(() => this.connect(), this.delay);
    this.delay = Math.min(this.delay * 2, 5000);
  }
}
