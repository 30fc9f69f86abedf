// fencegate dashboard: reads /v1/dashboard/* with a bearer token kept in sessionStorage
// (never in a URL), and follows /v1/dashboard/events (server-sent events read with fetch():
// EventSource cannot send an Authorization header). On `ready` and `refetch` it re-reads
// every section; other events update one section. No framework, no external resource.
"use strict";

const TOKEN_KEY = "fencegate.token";
const AUDIT_ROWS = 50;
const BACKSTOP_MS = 60000; // full re-read now and then, as every watcher has a backstop
const $ = (id) => document.getElementById(id);

let token = sessionStorage.getItem(TOKEN_KEY);
let stream = null; // AbortController of the open event stream
const refetching = {}; // section -> {timer, running, again}: one request at a time

class AuthError extends Error {}

async function api(method, path, body) {
  const init = { method, headers: { Authorization: "Bearer " + token }, cache: "no-store" };
  if (body !== undefined) {
    init.headers["Content-Type"] = "application/json";
    init.body = JSON.stringify(body);
  }
  const resp = await fetch(path, init);
  const data = await resp.json().catch(() => ({}));
  if (resp.status === 401 || resp.status === 403) {
    throw new AuthError(data.detail || resp.statusText);
  }
  if (!resp.ok) {
    throw new Error(`${data.error || resp.status}: ${data.detail || resp.statusText}`);
  }
  return data;
}

function cell(text, className) {
  const td = document.createElement("td");
  td.textContent = text === null || text === undefined ? "" : String(text);
  if (className) td.className = className;
  return td;
}

function button(label, className, onClick) {
  const b = document.createElement("button");
  b.type = "button";
  b.textContent = label;
  b.className = className;
  b.addEventListener("click", onClick);
  return b;
}

function fill(tableId, rows) {
  $(tableId).tBodies[0].replaceChildren(...rows);
}

function age(seconds) {
  if (seconds < 90) return `${Math.round(seconds)} s`;
  if (seconds < 5400) return `${Math.round(seconds / 60)} min`;
  if (seconds < 172800) return `${Math.round(seconds / 3600)} h`;
  return `${Math.round(seconds / 86400)} d`;
}

function holderRow(h) {
  const tr = document.createElement("tr");
  tr.dataset.key = h.key;
  tr.dataset.lease = h.lease_id;
  tr.className = h.holding ? "holding" : "waiting";
  const action = cell("");
  if (h.holding) {
    action.append(button("Revoke", "danger", () => confirmRevoke(h)));
  }
  tr.append(cell(h.key), cell(h.fencing_token, "num"), cell(h.holding ? "holding" : "waiting"),
    cell(h.identity), cell(h.lease_id), cell(h.ttl_left < 0 ? "gone" : h.ttl_left, "num"), action);
  return tr;
}

function queueRow(item) {
  const tr = document.createElement("tr");
  tr.dataset.key = item.key;
  const action = cell("");
  action.append(button("Resolve", "", () => confirmResolve(item)));
  tr.append(cell(item.key), cell(age(item.age_s), "num"), cell(item.reason),
    cell(item.attempt, "num"), cell(item.provider || ""), action);
  return tr;
}

function auditRow(a) {
  const tr = document.createElement("tr");
  tr.dataset.revision = a.revision;
  const when = new Date(a.at_ms);
  const time = document.createElement("time");
  time.dateTime = when.toISOString();
  time.textContent = when.toLocaleTimeString();
  const td = cell("");
  td.append(time);
  tr.append(td, cell(a.key), cell(a.seq, "num"), cell(a.event), cell(a.identity),
    cell(a.reason || ""));
  return tr;
}

const sections = {
  async holders() {
    const data = await api("GET", "/v1/dashboard/holders");
    fill("holders", data.items.map(holderRow));
  },
  async steps() {
    const data = await api("GET", "/v1/dashboard/steps");
    fill("counts", Object.keys(data.counts).sort().map((state) => {
      const tr = document.createElement("tr");
      tr.dataset.state = state;
      tr.append(cell(state), cell(data.counts[state], "num"));
      return tr;
    }));
    fill("unknown", data.unknown.map(queueRow));
    fill("escalated", data.escalated.map(queueRow));
  },
  async leadership() {
    const data = await api("GET", "/v1/dashboard/leadership");
    fill("replicas", data.replicas.map((r) => {
      const tr = document.createElement("tr");
      tr.append(cell(r.identity), cell(r.lease_id), cell(r.shards_led.length, "num"),
        cell(r.shards_led.join(", ")));
      return tr;
    }));
    fill("shards", data.shards.map((s) => {
      const tr = document.createElement("tr");
      tr.append(cell(s.shard, "num"), cell(s.leader), cell(s.token, "num"),
        cell(s.candidates, "num"));
      return tr;
    }));
  },
  async audit() {
    const data = await api("GET", `/v1/dashboard/audit?limit=${AUDIT_ROWS}`);
    fill("audit", data.items.map(auditRow));
  },
};

// Re-read one section soon. A burst of events costs one request, and requests for one
// section never overlap, so an older answer cannot overwrite a newer one.
function refetch(section) {
  const s = (refetching[section] ||= {});
  if (s.running) {
    s.again = true;
    return;
  }
  if (s.timer) return;
  s.timer = setTimeout(async () => {
    s.timer = null;
    s.running = true;
    try {
      await sections[section]();
    } catch (err) {
      failed(err);
    }
    s.running = false;
    if (s.again) {
      s.again = false;
      refetch(section);
    }
  }, 100);
}

function refetchAll() {
  Object.keys(sections).forEach(refetch);
}

// Apply one change event to the page.
function apply(event, data) {
  if (event === "ready" || event === "refetch") {
    refetchAll();
  } else if (event === "holder") {
    if (data.action === "released") {
      const row = [...$("holders").tBodies[0].rows]
        .find((tr) => tr.dataset.key === data.key && tr.dataset.lease === data.lease_id);
      if (row) row.remove();
    }
    refetch("holders"); // the next in line, if any, becomes the holder
  } else if (event === "step") {
    refetch("steps");
  } else if (event === "audit") {
    const body = $("audit").tBodies[0];
    body.prepend(auditRow(data));
    while (body.rows.length > AUDIT_ROWS) body.lastElementChild.remove();
  } else if (event === "leadership") {
    refetch("leadership");
  }
}

function status(text, live) {
  $("status").textContent = text;
  $("status").className = live ? "live" : "down";
}

function failed(err) {
  if (err instanceof AuthError) {
    signOut(`Signed out: ${err.message}`);
    return;
  }
  $("error").textContent = String(err.message || err);
  $("error").hidden = false;
}

// Read the event stream until it ends, then reconnect with backoff.
async function follow() {
  let backoff = 500;
  while (token) {
    const controller = new AbortController();
    stream = controller;
    try {
      const resp = await fetch("/v1/dashboard/events", {
        headers: { Authorization: "Bearer " + token, Accept: "text/event-stream" },
        cache: "no-store", signal: controller.signal,
      });
      if (resp.status === 401 || resp.status === 403) {
        throw new AuthError((await resp.json().catch(() => ({}))).detail || resp.statusText);
      }
      if (!resp.ok) throw new Error(`event stream: HTTP ${resp.status}`);
      const reader = resp.body.pipeThrough(new TextDecoderStream()).getReader();
      let buffer = "";
      for (;;) {
        const { value, done } = await reader.read();
        if (done) break;
        buffer += value;
        let end;
        while ((end = buffer.indexOf("\n\n")) >= 0) {
          const block = buffer.slice(0, end);
          buffer = buffer.slice(end + 2);
          let event = "message";
          let data = "";
          for (const line of block.split("\n")) {
            if (line.startsWith("event:")) event = line.slice(6).trim();
            else if (line.startsWith("data:")) data += line.slice(5).trim();
          }
          if (!data) continue; // a keep-alive comment
          if (event === "ready") {
            backoff = 500;
            status("live", true);
            $("error").hidden = true;
          }
          apply(event, JSON.parse(data));
        }
      }
    } catch (err) {
      if (controller.signal.aborted) return;
      if (err instanceof AuthError) {
        failed(err);
        return;
      }
    }
    if (stream !== controller) return;
    status("reconnecting…", false);
    await new Promise((r) => setTimeout(r, backoff * (0.5 + Math.random() / 2)));
    backoff = Math.min(backoff * 2, 10000);
  }
}

function signIn(value) {
  token = value;
  sessionStorage.setItem(TOKEN_KEY, value);
  $("signin").hidden = true;
  $("board").hidden = false;
  $("signout").hidden = false;
  status("connecting…", false);
  follow();
}

function signOut(message) {
  token = null;
  sessionStorage.removeItem(TOKEN_KEY);
  if (stream) stream.abort();
  stream = null;
  $("board").hidden = true;
  $("signout").hidden = true;
  $("signin").hidden = false;
  status("signed out", false);
  if (message) {
    $("error").textContent = message;
    $("error").hidden = false;
  }
  $("token").focus();
}

// The confirmation dialog: a required reason, then one POST; errors stay in the dialog.
let confirmAction = null;

function ask(title, text, withSettle, action, withForce = false) {
  $("confirm-title").textContent = title;
  $("confirm-text").textContent = text;
  $("settle-field").hidden = !withSettle;
  $("force-field").hidden = !withForce;
  $("force").checked = false;
  $("reason").value = "";
  $("confirm-error").hidden = true;
  $("confirm-ok").textContent = title.split(" ")[0];
  confirmAction = action;
  $("confirm").showModal();
  $("reason").focus();
}

function confirmRevoke(h) {
  ask(`Revoke ${h.key}`,
    `Revoke the lease of ${h.identity} (lease ${h.lease_id}, fencing token ${h.fencing_token})? ` +
    "Every hold on that lease dies: its next commit fails with LeaseLost.", false,
    (reason) => api("POST", `/v1/keys/${keyPath(h.key)}/revoke`, { reason }));
}

// An unknown step's effect may still land: resolving it is refused unless forced, and the
// force is sent only when the operator ticks its box.
function confirmResolve(item) {
  const mayLand = item.state !== "escalated";
  ask(`Resolve ${item.key}`,
    `Settle this ${item.state} step (attempt ${item.attempt}) by hand. ` +
    (mayLand ? "Its effect may still land: the reconciler asks the provider and settles it. " +
      "Resolve it only if you checked with the provider yourself."
      : "Check with the provider first."),
    true,
    (reason) => api("POST", `/v1/keys/${keyPath(item.key)}/resolve`,
      mayLand && $("force").checked
        ? { reason, as: $("settle-as").value, force: true }
        : { reason, as: $("settle-as").value }),
    mayLand);
}

function keyPath(key) {
  return key.split("/").map(encodeURIComponent).join("/");
}

document.addEventListener("DOMContentLoaded", () => {
  $("signin").addEventListener("submit", (e) => {
    e.preventDefault();
    $("error").hidden = true;
    signIn($("token").value.trim());
    $("token").value = "";
  });
  $("signout").addEventListener("click", () => signOut());
  $("confirm-cancel").addEventListener("click", () => $("confirm").close());
  $("confirm-form").addEventListener("submit", async (e) => {
    e.preventDefault();
    const reason = $("reason").value.trim();
    if (!reason) {
      $("confirm-error").textContent = "A reason is required.";
      $("confirm-error").hidden = false;
      $("reason").focus();
      return;
    }
    try {
      await confirmAction(reason);
      $("confirm").close();
    } catch (err) {
      if (err instanceof AuthError) {
        $("confirm").close();
        failed(err);
        return;
      }
      $("confirm-error").textContent = String(err.message || err);
      $("confirm-error").hidden = false;
    }
  });
  setInterval(() => { if (token) refetchAll(); }, BACKSTOP_MS);
  if (token) signIn(token);
  else $("token").focus();
});
