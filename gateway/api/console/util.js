// Small DOM helpers. Every value from the API goes through textContent or an attribute,
// never through innerHTML: nothing a device or a person typed can become markup.

export function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs)) {
    if (value === null || value === undefined || value === false) continue;
    if (key === "class") node.className = value;
    else if (key === "text") node.textContent = String(value);
    else if (key.startsWith("on") && typeof value === "function") node.addEventListener(key.slice(2), value);
    else if (key === "dataset") Object.assign(node.dataset, value);
    else node.setAttribute(key, value === true ? "" : String(value));
  }
  for (const child of children.flat()) {
    if (child === null || child === undefined || child === false) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

// node.append() writes null as "null": this leaves out what is absent, as el() does.
export function append(node, ...children) {
  for (const child of children.flat()) {
    if (child === null || child === undefined || child === false) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

export function clear(node) {
  while (node.firstChild) node.removeChild(node.firstChild);
  return node;
}

// Every date on every page goes through here: ISO 8601 order (2026-12-02 16:05:09), in the
// browser's time zone, on a 24-hour clock; its title (and a <time>'s datetime) carries the
// full ISO 8601 form with the zone's offset. One format whatever the browser's language: a
// control room reads "2026-12-02" the same everywhere, "02/12/2026" it does not.
const pad = (n, width = 2) => String(n).padStart(width, "0");

function dateOf(value) {
  if (value === null || value === undefined || value === "") return null;
  const date = value instanceof Date ? value : new Date(value);
  return Number.isNaN(date.getTime()) ? null : date;
}

// The date's UTC offset in the browser's zone, ISO 8601 style: "+01:00", "-05:30", "Z".
export function offset(date) {
  const minutes = -date.getTimezoneOffset();
  if (minutes === 0) return "Z";
  const sign = minutes > 0 ? "+" : "-";
  const abs = Math.abs(minutes);
  return `${sign}${pad(Math.floor(abs / 60))}:${pad(abs % 60)}`;
}

// "2026-12-02 16:05:09" (local); "—" for nothing; the text itself when it is not a date.
export function when(value) {
  if (value === null || value === undefined || value === "") return "—";
  const date = dateOf(value);
  if (date === null) return String(value);
  return `${date.getFullYear()}-${pad(date.getMonth() + 1)}-${pad(date.getDate())} ${clock(date)}`;
}

// "16:05:09" (local): a chart's axis, where the day is plain.
export function clock(value) {
  const date = dateOf(value);
  if (date === null) return "—";
  return `${pad(date.getHours())}:${pad(date.getMinutes())}:${pad(date.getSeconds())}`;
}

// The full ISO 8601 form in the browser's zone: "2026-12-02T16:05:09.120+01:00".
export function isoLocal(value) {
  const date = dateOf(value);
  if (date === null) return "";
  return `${when(date).replace(" ", "T")}.${pad(date.getMilliseconds(), 3)}${offset(date)}`;
}

// The gateway's clock, as the page knows it: the browser's, corrected by how far it is from the
// `Date` of the gateway's answers (learnt by noteServerDate). Every time the API sends is on the
// gateway's clock; counted from a browser's own, a control-room tablet ten minutes behind said
// "just now" of a device silent for ten minutes. Within a second or so (`Date` has seconds).
let clockOffsetMs = 0;
// What the answers so far say of that offset: it lies between `low` and `high` (ms), or null
// before the first answer.
let offsetBounds = null;

export function now() {
  return Date.now() + clockOffsetMs;
}

// An answer's `Date` header, read when it came (`receivedMs`, the browser's clock) to a request
// sent at `sentMs`. The gateway read its clock for that header (`at`, whole seconds: somewhere
// in [at, at + 1 s)) at some moment between the two, where exactly nobody knows: an answer
// slow to compute is stamped near its end, one slow on the way back near its start. So the
// offset lies in [at - receivedMs, at + 1 s - sentMs], as wide as the answer was slow, and
// each answer narrows what the earlier ones said (NTP's way, its filter kept to this). Taking
// the middle of each answer alone, as the console did, a single answer 6 s slow moved the
// clock up to 3 s, and the next quick one moved it back. An answer whose range misses the
// one kept means a clock was set meanwhile (the browser's or the gateway's): it starts over.
// An offset under 2 s is taken for none (the header's own second, the way).
export function noteServerDate(header, sentMs, receivedMs) {
  const at = header ? Date.parse(header) : NaN;
  if (!Number.isFinite(at) || receivedMs < sentMs) return;
  const low = at - receivedMs;
  const high = at + 1000 - sentMs;
  if (offsetBounds && low <= offsetBounds.high && high >= offsetBounds.low) {
    offsetBounds = { low: Math.max(low, offsetBounds.low), high: Math.min(high, offsetBounds.high) };
  } else {
    offsetBounds = { low, high };
  }
  const offset = (offsetBounds.low + offsetBounds.high) / 2;
  clockOffsetMs = Math.abs(offset) < 2000 ? 0 : Math.round(offset);
}

function span(seconds) {
  if (seconds < 90) return `${seconds} s`;
  if (seconds < 5400) return `${Math.round(seconds / 60)} min`;
  if (seconds < 172800) return `${Math.round(seconds / 3600)} h`;
  return `${Math.round(seconds / 86400)} days`;
}

// "just now", "5 min ago"; a time ahead of the gateway's clock (a device's clock set ahead
// dates its readings so) "8 h ahead": it used to read "just now", as a fresh reading would.
export function ago(value) {
  if (!value) return "never";
  const seconds = Math.round((now() - new Date(value).getTime()) / 1000);
  if (!Number.isFinite(seconds)) return String(value);
  if (seconds <= -5) return `${span(-seconds)} ahead`;
  if (seconds < 5) return "just now";
  return `${span(seconds)} ago`;
}

export function timeEl(value, relative = false) {
  return el("time", { datetime: value || null, title: value ? isoLocal(value) : null, text: relative ? ago(value) : when(value) });
}

// Where an alarm's device page opens: on the alarm's metric (a threshold rule's), with that
// rule's lines drawn (#/devices/<id>?metric=<m>&rule=<key>). For the alarm views to link with.
export function deviceHref(deviceId, { metric = null, rule = null } = {}) {
  const search = new URLSearchParams();
  if (metric) search.set("metric", metric);
  if (rule) search.set("rule", rule);
  const text = search.toString();
  return `#/devices/${encodeURIComponent(deviceId)}${text ? `?${text}` : ""}`;
}

export function bytes(size) {
  if (size === null || size === undefined) return "—";
  if (size < 1024) return `${size} B`;
  if (size < 1024 * 1024) return `${(size / 1024).toFixed(1)} KiB`;
  return `${(size / 1024 / 1024).toFixed(1)} MiB`;
}

export function number(value) {
  if (typeof value !== "number") return String(value);
  // As sent, with at most 6 significant digits (a float's noise is not a reading).
  return String(Number(value.toPrecision(6)));
}

// A list's readings, numbered: `const current = reading();` before asking, `current()` once
// answered says whether it is still the newest. One answered after a newer one began (a slow
// answer to the filters before, a poll overtaken by Filter) is dropped, never painted over
// what the form now says. The page counts them in `window.__readingsDropped`.
export function readings() {
  let newest = 0;
  return () => {
    const mine = ++newest;
    return () => {
      if (mine === newest) return true;
      window.__readingsDropped = (window.__readingsDropped || 0) + 1;
      return false;
    };
  };
}

// At most one run per `ms`, however many calls: a burst of events (a hundred devices) costs
// one read, the last call is never lost, and two runs never overlap.
export function throttle(fn, ms) {
  let timer = null;
  let running = false;
  let again = false;
  const run = async () => {
    timer = null;
    if (running) { again = true; return; }
    running = true;
    try { await fn(); } finally {
      running = false;
      if (again) { again = false; schedule(); }
    }
  };
  const schedule = () => { if (timer === null) timer = setTimeout(run, ms); };
  return schedule;
}
