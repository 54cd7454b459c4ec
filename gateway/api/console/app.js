// The console's entry: sign-in (the token stays in this tab's sessionStorage), the role from
// GET /me, the sections behind #/ routes, and the live stream feeding them.
import { AlarmsView } from "./alarms.js";
import { Api } from "./api.js";
import { CampaignsView } from "./campaigns.js";
import { CommandsView } from "./commands.js";
import { DeadLettersView } from "./deadletters.js";
import { DevicesView } from "./devices.js";
import { NotificationsView } from "./notifications.js";
import { StatsView } from "./stats.js";
import { LiveStream } from "./stream.js";

const TOKEN_KEY = "gateway.token";
const ROLES = { viewer: 1, operator: 2, admin: 3 };
const SECTIONS = ["alarms", "devices", "commands", "campaigns", "notifications", "figures", "dead-letters"];

const $ = (id) => document.getElementById(id);

const state = { api: null, me: null, stream: null, views: null, section: null };

function notify(message, kind = "error") {
  // Signed out (the token refused, or Sign out): the sign-in says what there is to say; a
  // view's read that failed for it ("Commands: …") is no news beside it.
  if (state.api === null) return;
  const box = $("notice");
  box.textContent = message;
  box.className = kind === "ok" ? "notice ok" : "notice";
  box.hidden = false;
}

function canAct() {
  return state.me !== null && ROLES[state.me.role] >= ROLES.operator;
}

function isAdmin() {
  return state.me !== null && ROLES[state.me.role] >= ROLES.admin;
}

const ctx = {
  get api() { return state.api; },
  canAct,
  notify,
  navigate: (hash) => { location.hash = hash; },
  current: () => state.section,
};

function showSignIn(message) {
  if (state.stream) state.stream.stop();
  state.stream = null;
  state.api = null;
  state.me = null;
  // The views' own timers stop (the commands' read every 2 s, the deliveries' every 3 or
  // 10 s): signed out, nothing is read until someone signs in again.
  if (state.views) for (const view of Object.values(state.views)) if (view.hide) view.hide();
  state.section = null;
  sessionStorage.removeItem(TOKEN_KEY);
  $("sign-in").hidden = false;
  $("nav").hidden = true;
  $("session").hidden = true;
  $("notice").hidden = true;
  for (const section of SECTIONS) $(`view-${section}`).hidden = true;
  $("sign-in-error").textContent = message || "";
  $("token").value = "";
  $("token").focus();
}

// What the token's role allows, shown: the header, Dead letters, the operators' forms.
function showRole(me) {
  $("who").textContent = `${me.name} (${me.role})`;
  $("nav-dead-letters").hidden = !isAdmin();
  for (const node of document.querySelectorAll(".operator-only")) node.hidden = !canAct();
}

// A 403: the gateway gives this token a weaker role than the page knew (a reload changed
// it). The page asks again who the token is and shows what the role now allows; it used to
// keep the old role's header and buttons, each refused when clicked.
let askingRole = false;
async function roleRefused(api) {
  if (askingRole || state.api !== api) return;
  askingRole = true;
  let me;
  try {
    me = await api.get("/me");
  } catch {
    return;
  } finally {
    askingRole = false;
  }
  if (state.api !== api || state.me === null || me.role === state.me.role) return;
  state.me = me;
  showRole(me);
  if (state.section === "dead-letters" && !isAdmin()) {
    history.replaceState(null, "", "#/alarms");
    await route();
    notify(`The gateway now gives this token the ${me.role} role: Dead letters are for admins.`);
  } else {
    await state.views[state.section].refresh();
  }
}

async function signIn(token, { remembered = false } = {}) {
  const api = new Api(token, () => {
    if (state.api === api) showSignIn("The gateway no longer accepts this token. Sign in again.");
  }, () => roleRefused(api));
  let me;
  try {
    me = await api.get("/me");
  } catch (error) {
    if (remembered) sessionStorage.removeItem(TOKEN_KEY);
    $("sign-in-error").textContent = error.status === 401
      ? "This token was refused: check it and try again."
      : `Cannot sign in: ${error.message}`;
    $("token").focus();
    return;
  }
  sessionStorage.setItem(TOKEN_KEY, token);
  state.api = api;
  state.me = me;
  $("sign-in").hidden = true;
  $("sign-in-error").textContent = "";
  $("token").value = "";
  $("nav").hidden = false;
  $("session").hidden = false;
  showRole(me);
  state.views = state.views || {
    alarms: new AlarmsView(ctx),
    devices: new DevicesView(ctx),
    commands: new CommandsView(ctx),
    campaigns: new CampaignsView(ctx),
    notifications: new NotificationsView(ctx),
    figures: new StatsView(ctx),
    "dead-letters": new DeadLettersView(ctx),
  };
  state.stream = new LiveStream(api, {
    onEvent: (event) => {
      for (const view of Object.values(state.views)) if (view.onEvent) view.onEvent(event);
    },
    onState: (kind, text) => {
      $("live").dataset.state = kind;
      $("live").textContent = text;
    },
    // Back after a cut: what the stream resumed covers the outbox; read the view again too.
    onResumed: () => state.views[state.section].refresh(),
    // Started anew without a cursor (the gateway could not resume after it): what the page
    // missed is not replayed, so every view is read again (the others when shown).
    onReset: () => {
      for (const [name, view] of Object.entries(state.views)) if (name !== state.section && "stale" in view) view.stale = true;
      state.views[state.section].refresh();
    },
  });
  state.stream.start();
  if (!location.hash || location.hash === "#" || location.hash === "#/") location.hash = "#/alarms";
  else route();
}

function parseHash() {
  const [path, search] = location.hash.replace(/^#\/?/, "").split("?");
  const parts = path.split("/").filter(Boolean).map(decodeURIComponent);
  return { section: parts[0] || "alarms", id: parts[1] || null, params: Object.fromEntries(new URLSearchParams(search || "")) };
}

async function route() {
  if (!state.api) return;
  let { section, id, params } = parseHash();
  if (!SECTIONS.includes(section) || (section === "dead-letters" && !isAdmin())) section = "alarms";
  // The view left stops its own timed reads (Commands' 2 s, Devices' 10 s, Notifications').
  if (state.section && state.section !== section && state.views[state.section].hide) state.views[state.section].hide();
  state.section = section;
  for (const name of SECTIONS) $(`view-${name}`).hidden = name !== section;
  for (const link of document.querySelectorAll("#nav a")) {
    if (link.dataset.section === section) link.setAttribute("aria-current", "page");
    else link.removeAttribute("aria-current");
  }
  $("notice").hidden = true;
  await state.views[section].show(id, params);
}

$("sign-in-form").addEventListener("submit", (event) => {
  event.preventDefault();
  const token = $("token").value.trim();
  if (token) signIn(token);
});
$("sign-out").addEventListener("click", () => {
  showSignIn("");
});
window.addEventListener("hashchange", route);

const remembered = sessionStorage.getItem(TOKEN_KEY);
if (remembered) signIn(remembered, { remembered: true });
else showSignIn("");
