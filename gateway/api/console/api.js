// The operator API as the page uses it: the signed-in token in the Authorization header,
// JSON in and out, every error as an ApiError with the API's code and message.

import { noteServerDate } from "./util.js";

export class ApiError extends Error {
  constructor(status, body) {
    const message = (body && body.message) || `HTTP ${status}`;
    super(message);
    this.status = status;
    this.body = body || {};
    this.code = this.body.error || `HTTP_${status}`;
  }
}

// Where an API path (`/alarms?…`, as docs/api.md writes it) is for this page: relative to the
// page's own address, not the host's root. Served at `/` that is the same URL; behind a reverse
// proxy at a prefix (the site's `/gateway/` passed to the gateway's `/`) it is under the
// prefix, where the host's root is some other site (docs/deploying.md, "Behind a reverse proxy").
export function apiUrl(path) {
  return new URL(path.replace(/^\/+/, ""), document.baseURI).href;
}

const UNREACHABLE = "the gateway does not answer (is it running?)";

// An answer that is not JSON is not the gateway's (its errors are all JSON): a reverse proxy's
// own page, 502/503/504 while the gateway behind it is down, restarting or slow. Said in words
// as a gateway that does not answer is, never as the proxy's markup.
function notJson(response, text) {
  const status = response.status;
  if (status === 502 || status === 503 || status === 504) {
    return { error: "UNREACHABLE", message: `${UNREACHABLE} (the proxy in front answers ${status})` };
  }
  if ((response.headers.get("Content-Type") || "").startsWith("text/html")) {
    return { error: `HTTP_${status}`, message: `HTTP ${status}, not from the gateway (a proxy in front?)` };
  }
  return { error: `HTTP_${status}`, message: text.slice(0, 200) };
}

export class Api {
  constructor(token, onUnauthorized = () => {}, onForbidden = () => {}) {
    this.token = token;
    this.onUnauthorized = onUnauthorized;
    this.onForbidden = onForbidden;
  }

  // timeoutMs: given up after that long (the answer not come, or not all of it), as unanswered.
  async call(method, path, body, { timeoutMs = null } = {}) {
    const headers = { Authorization: `Bearer ${this.token}`, Accept: "application/json" };
    const init = { method, headers, cache: "no-store" };
    if (timeoutMs !== null) init.signal = AbortSignal.timeout(timeoutMs);
    if (body !== undefined) {
      headers["Content-Type"] = "application/json";
      init.body = JSON.stringify(body);
    }
    let response;
    const sentMs = Date.now();
    try {
      response = await fetch(apiUrl(path), init);
      noteServerDate(response.headers.get("Date"), sentMs, Date.now());
    } catch (error) {
      throw new ApiError(0, { error: "UNREACHABLE", message: UNREACHABLE });
    }
    let data = null;
    let text;
    try {
      text = await response.text();
    } catch (error) {
      throw new ApiError(0, { error: "UNREACHABLE", message: UNREACHABLE });
    }
    if (text) {
      try { data = JSON.parse(text); } catch { data = notJson(response, text); }
    } else if (!response.ok) {
      data = notJson(response, "");
    }
    if (!response.ok) {
      const error = new ApiError(response.status, data);
      if (response.status === 401) this.onUnauthorized(error);
      if (response.status === 403) this.onForbidden(error);
      throw error;
    }
    return data;
  }

  get(path) { return this.call("GET", path); }
  post(path, body, options) { return this.call("POST", path, body, options); }
  put(path, body) { return this.call("PUT", path, body); }
  delete(path) { return this.call("DELETE", path); }
}

export function query(params) {
  const search = new URLSearchParams();
  for (const [key, value] of Object.entries(params)) {
    if (value === null || value === undefined || value === "" || value === false) continue;
    if (Array.isArray(value)) value.forEach((v) => search.append(key, v));
    else search.append(key, String(value));
  }
  const text = search.toString();
  return text ? `?${text}` : "";
}
