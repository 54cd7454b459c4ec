// The live stream: Server-Sent Events from GET /stream, opened with a single-use ticket
// (EventSource cannot send an Authorization header, and the token never goes in a URL).
//
// A ticket is good for one connection, so the browser's own reconnect (same URL) would be
// refused: on any error the page closes the EventSource and opens a new one with a fresh
// ticket and the id of the last event it saw, from which the gateway resumes with no gap
// and no duplicate. Retries back off from half a second to five.
//
// A resume the gateway refuses for good, 400 CURSOR_AHEAD (the database it came back to has no
// event as new as the one the page saw: a failover to a standby that was behind, a restore),
// would fail the same way forever. EventSource does not say why it failed, so a connection
// with a cursor that failed before it opened asks the gateway with a plain request: for
// CURSOR_AHEAD the page drops the cursor (onReset: every view is read again) and starts anew.

// EventSource hands a named event only to listeners of that name: these are the outbox's.
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
    this.source = null;
    this.timer = null;
    this.delay = 500;
    this.stopped = false;
    this.everOpened = false;
  }

  start() {
    this.stopped = false;
    this.connect();
  }

  stop() {
    this.stopped = true;
    clearTimeout(this.timer);
    if (this.source) this.source.close();
    this.source = null;
    this.onState("off", "not live");
  }

  async connect() {
    if (this.stopped) return;
    this.onState(this.everOpened ? "reconnecting" : "connecting", this.everOpened ? "reconnecting…" : "connecting…");
    let ticket;
    try {
      ticket = (await this.api.post("/stream/tickets", {})).ticket;
    } catch (error) {
      if (error.status === 401) return; // signed out by the API wrapper
      this.retry();
      return;
    }
    if (this.stopped) return;
    const params = new URLSearchParams({ ticket });
    const cursor = this.lastEventId;
    if (cursor) params.set("last_event_id", cursor);
    const source = new EventSource(`/stream?${params}`);
    this.source = source;
    let opened = false;
    source.addEventListener("open", () => {
      opened = true;
      const resumed = this.everOpened;
      this.everOpened = true;
      this.delay = 500;
      this.onState("live", "live");
      if (this.resetting) {
        this.resetting = false;
        this.onReset();
      } else if (resumed) this.onResumed();
    });
    source.addEventListener("error", async () => {
      if (this.source !== source) return;
      source.close();
      this.source = null;
      if (!opened && cursor && cursor === this.lastEventId && await this.cursorAhead(cursor)) {
        if (this.lastEventId !== cursor || this.stopped) return;
        this.lastEventId = null;
        this.resetting = true;
      }
      this.retry();
    });
    for (const type of EVENT_TYPES) {
      source.addEventListener(type, (message) => {
        if (message.lastEventId) this.lastEventId = message.lastEventId;
        let event;
        try { event = JSON.parse(message.data); } catch { return; }
        this.onEvent(event);
      });
    }
  }

  // Whether the gateway refuses to resume after this cursor for good (400 CURSOR_AHEAD). The
  // request carries the token in its header, as every API call; any other answer (the gateway
  // away, a stream opened: closed at once, unread) is not that.
  async cursorAhead(cursor) {
    const controller = new AbortController();
    try {
      const response = await fetch(`/stream?${new URLSearchParams({ last_event_id: cursor })}`, {
        headers: { Authorization: `Bearer ${this.api.token}`, Accept: "application/json" },
        cache: "no-store",
        signal: controller.signal,
      });
      if (response.status !== 400) return false;
      const body = await response.json();
      return Boolean(body && body.error === "CURSOR_AHEAD");
    } catch {
      return false;
    } finally {
      controller.abort();
    }
  }

  retry() {
    if (this.stopped) return;
    this.onState("reconnecting", "reconnecting…");
    clearTimeout(this.timer);
    this.timer = setTimeout(() => this.connect(), this.delay);
    this.delay = Math.min(this.delay * 2, 5000);
  }
}
