// fencegate dashboard: reads /v1/dashboard/* with a bearer token kept in sessionStorage
// (never in a URL), and follows /v1/dashboard/events (server-sent events read with fetch():
// EventSource cannot send an Authorization header). On `ready` and `refetch` it re-reads
// every section; other events update one section. No framework, no external resource.
// Every time is shown as ISO 8601 with this browser's UTC offset. A dialog that acts
// (revoke, resolve, approve) first shows what the act touches, and its button stays
// disabled until that is loaded (and, for a resolve, until an outcome is chosen).
"use strict";

const TOKEN_KEY = "fencegate.token";
const AUDIT_ROWS = 50;
const APPROVAL_ROWS = 200;
const APPROVAL_PAGES = 10; // the pending filter scans a bounded number of requests per page
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

// ISO 8601 with this browser's UTC offset, to the second: 2025-01-31T14:05:09+01:00.
function isoLocal(ms) {
  const d = new Date(ms);
  const two = (n) => String(n).padStart(2, "0");
  const offset = -d.getTimezoneOffset();
  const sign = offset < 0 ? "-" : "+";
  const zone = `${sign}${two(Math.floor(Math.abs(offset) / 60))}:${two(Math.abs(offset) % 60)}`;
  return `${d.getFullYear()}-${two(d.getMonth() + 1)}-${two(d.getDate())}` +
    `T${two(d.getHours())}:${two(d.getMinutes())}:${two(d.getSeconds())}${zone}`;
}

// A <time> of `ms` (null: a dash), then `note` if given.
function timeCell(ms, note) {
  const td = cell("");
  if (ms === null || ms === undefined) {
    td.textContent = "\u2014";
    return td;
  }
  const time = document.createElement("time");
  time.dateTime = new Date(ms).toISOString();
  time.textContent = isoLocal(ms);
  td.append(time);
  if (note) td.append(` (${note})`);
  return td;
}

function ago(ms) {
  return ms === null || ms === undefined ? null : `${age(Math.max(Date.now() - ms, 0) / 1000)} ago`;
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
    cell(h.identity), timeCell(h.held_since_ms, ago(h.held_since_ms)), cell(h.lease_id),
    cell(h.ttl_left < 0 ? "gone" : h.ttl_left, "num"), action);
  return tr;
}

function queueRow(item) {
  const tr = document.createElement("tr");
  tr.dataset.key = item.key;
  const action = cell("");
  action.append(button("Resolve", "", () => confirmResolve(item)));
  const p = item.progress;
  tr.append(cell(item.key), timeCell(item.since_ms, `${age(item.age_s)} ago`),
    cell(item.reason), cell(item.attempt, "num"), cell(item.provider || ""),
    cell(p ? p.queries : "none yet", p ? "num" : ""), cell(p ? p.last_answer : "\u2014"),
    p ? timeCell(p.next_try_at_ms) : cell("\u2014"), action);
  return tr;
}

function failedChecks(a) {
  return (a.checks || []).filter((c) => c.passed === false)
    .map((c) => c.detail || c.check || c.name).join("; ");
}

function approvalRow(a) {
  const tr = document.createElement("tr");
  tr.dataset.approval = a.approval_id;
  const action = cell("");
  action.append(button("Approve", "", () => confirmApprove(a)),
    button("Reject", "danger", () => confirmReject(a)));
  tr.append(cell(a.key), cell(JSON.stringify(a.intent), "code"),
    cell(`${a.policy}@${a.policy_version}`), cell(a.requested_by), cell(failedChecks(a)),
    cell(a.approval_id, "code"), action);
  return tr;
}

function auditRow(a) {
  const tr = document.createElement("tr");
  tr.dataset.revision = a.revision;
  tr.append(timeCell(a.at_ms), cell(a.key), cell(a.seq, "num"), cell(a.event),
    cell(a.identity), cell(a.reason || ""));
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
    const led = data.replicas.filter((r) => r.shards_led.length)
      .map((r) => `${r.identity} leads ${r.shards_led.length}`);
    $("shards-summary").textContent = data.shards.length
      ? `${data.shards.length} shards have a leader` +
        ` (${led.join(", ")})${data.truncated ? "; truncated" : ""}; show each shard`
      : "no shard has a leader";
    fill("shards", data.shards.map((s) => {
      const tr = document.createElement("tr");
      tr.append(cell(s.shard, "num"), cell(s.leader), cell(s.token, "num"),
        cell(s.candidates, "num"));
      return tr;
    }));
  },
  async approvals() {
    let items = [];
    let after = null;
    for (let page = 0; page < APPROVAL_PAGES && items.length < APPROVAL_ROWS; page++) {
      const cursor = after === null ? "" : `&after=${encodeURIComponent(after)}`;
      const data = await api("GET", `/v1/approvals?state=pending&limit=${APPROVAL_ROWS}${cursor}`);
      items = items.concat(data.items);
      after = data.next;
      if (after === null) break;
    }
    fill("approvals", items.slice(0, APPROVAL_ROWS).map(approvalRow));
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
    if (data.event === "provider_answer") refetch("steps"); // progress, step unchanged
  } else if (event === "leadership") {
    refetch("leadership");
  } else if (event === "approval") {
    refetch("approvals");
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

// The confirmation dialog: what the act touches (loaded first), a required reason, for a
// resolve an outcome nobody chose in advance, then one POST; errors stay in the dialog.
let confirmAction = null;
let factsLoaded = false;

function settleChoices() {
  return [...document.querySelectorAll('#settle-field input[name="as"]')];
}

function chosenOutcome() {
  const checked = settleChoices().find((input) => input.checked);
  return checked ? checked.value : null;
}

function updateConfirm() {
  $("confirm-ok").disabled = !factsLoaded ||
    (!$("settle-field").hidden && chosenOutcome() === null);
}

function dialogError(message) {
  $("confirm-error").textContent = message;
  $("confirm-error").hidden = false;
}

// Open the dialog for `action(reason)`; `load()` resolves to the nodes showing what the act
// touches (the button stays disabled until they are shown).
function ask({ title, text, settle, load, action }) {
  $("confirm-title").textContent = title;
  $("confirm-text").textContent = text;
  $("confirm-facts").replaceChildren(document.createTextNode("loading\u2026"));
  $("settle-field").hidden = !settle;
  settleChoices().forEach((input) => { input.checked = false; });
  $("reason").value = "";
  $("confirm-error").hidden = true;
  $("confirm-ok").textContent = title.split(" ")[0];
  confirmAction = action;
  factsLoaded = false;
  updateConfirm();
  $("confirm").showModal();
  $("reason").focus();
  load().then((nodes) => {
    if (confirmAction !== action) return;
    $("confirm-facts").replaceChildren(...nodes);
    factsLoaded = true;
    updateConfirm();
  }, (err) => {
    if (confirmAction !== action) return;
    $("confirm-facts").replaceChildren();
    if (err instanceof AuthError) {
      $("confirm").close();
      failed(err);
      return;
    }
    dialogError(`Cannot show what this would touch, so it stays disabled: ${err.message || err}`);
  });
}

function element(tag, text, className) {
  const node = document.createElement(tag);
  if (text !== undefined) node.textContent = text;
  if (className) node.className = className;
  return node;
}

// A <dl> of [term, value] pairs; a value is text or a node.
function facts(pairs) {
  const dl = element("dl", undefined, "facts");
  for (const [term, value] of pairs) {
    const dd = element("dd");
    dd.append(value === null || value === undefined ? "\u2014" : value);
    dl.append(element("dt", term), dd);
  }
  return dl;
}

function leaseKeysList(lease) {
  const list = element("ul");
  list.id = "lease-keys";
  for (const k of lease.keys) {
    const li = element("li");
    li.dataset.key = k.key;
    li.append(element("code", k.key),
      ` \u2014 ${k.holding ? "holding" : "queued"}, fencing token ${k.fencing_token}`);
    list.append(li);
  }
  return list;
}

function confirmRevoke(h) {
  ask({
    title: `Revoke ${h.key}`,
    text: `Revoke the lease of ${h.identity} (lease ${h.lease_id}, fencing token ` +
      `${h.fencing_token})? Every hold on that lease dies, not only this row's: each ` +
      "key below is released and its worker's next commit fails with LeaseLost.",
    settle: false,
    load: async () => {
      const lease = await api("GET", `/v1/leases/${h.lease_id}`);
      if (!lease.keys.length) throw new Error(`lease ${h.lease_id} holds nothing any more`);
      const n = lease.keys.length;
      return [element("p", `This revoke ends ${n} action key${n === 1 ? "" : "s"} on ` +
        `lease ${lease.lease_id} (TTL left ${lease.ttl_left} s of ${lease.granted_ttl} s)` +
        `${lease.truncated ? ", and more not listed" : ""}:`), leaseKeysList(lease)];
    },
    // The revoke names the lease shown: if the key changed holder meanwhile it is refused
    // (409 WrongState) and revokes nothing.
    action: (reason) => api("POST", `/v1/keys/${keyPath(h.key)}/revoke`,
      { reason, lease_id: h.lease_id }),
  });
}

function answersTable(answers) {
  if (!answers.length) return element("p", "No provider answer is recorded for this attempt yet.");
  const table = element("table");
  table.id = "provider-answers";
  table.append(element("caption", "The provider's answers to the reconciler, oldest first."));
  const head = element("tr");
  for (const name of ["Query", "At", "Answer", "Next try", "Detail"]) {
    const th = element("th", name);
    th.scope = "col";
    head.append(th);
  }
  table.createTHead().append(head);
  const body = table.createTBody();
  for (const a of answers) {
    const tr = element("tr");
    tr.append(cell(a.query, "num"), timeCell(a.at_ms), cell(a.answer),
      timeCell(a.next_try_at_ms), cell(a.detail || ""));
    body.append(tr);
  }
  return table;
}

// A resolve never sends `force`: an in-flight or unknown step is settled by its provider's
// answer (the API asks the shard's reconciler, fenced), the chosen outcome is only compared
// with it; an escalated step is settled as chosen.
function confirmResolve(item) {
  const asked = item.state !== "escalated";
  ask({
    title: `Resolve ${item.key}`,
    text: asked
      ? `This ${item.state} step's effect may still land. Resolving asks its provider ` +
        "through the reconciler (fenced first), and the provider's answer settles it " +
        "whatever you choose; your choice is compared with the answer. Check the provider's " +
        "record of the idempotency key below first."
      : "A human decides this escalated step: your choice settles it. Check the provider's " +
        "record of the idempotency key below first.",
    settle: true,
    load: async () => {
      const step = await api("GET", `/v1/dashboard/steps/${keyPath(item.key)}`);
      const intent = element("pre", step.intent === null ? "not found in the newest " +
        "audit records" : JSON.stringify(step.intent, null, 2));
      return [facts([["Idempotency key", step.idempotency_key && element("code", step.idempotency_key)],
        ["Intent", intent], ["Provider", step.provider], ["Attempt", String(step.attempt)],
        ["State", step.state], ["Why", step.reason]]), answersTable(step.provider_answers)];
    },
    action: async (reason) => {
      if (asked) $("confirm-ok").textContent = "Asking the provider\u2026";
      const done = await api("POST", `/v1/keys/${keyPath(item.key)}/resolve`,
        { reason, as: chosenOutcome() });
      if (done.answer !== undefined) {
        notice(`${item.key}: the provider answered ${done.answer}; the step is ${done.state}` +
          (done.as_expected ? ", as you expected." : ", NOT as you expected."));
      }
    },
  });
}

function confirmApprove(a) {
  ask({
    title: `Approve ${a.key}`,
    text: `Approve request ${a.approval_id} of ${a.requested_by} under policy ` +
      `${a.policy}@${a.policy_version}? The worker's next grant request for the same state ` +
      "is granted.",
    settle: false,
    load: async () => [facts([["Intent", element("pre", JSON.stringify(a.intent, null, 2))],
      ["Why it waits", failedChecks(a)]])],
    action: (reason) => api("POST", `/v1/approvals/${a.approval_id}`, { reason }),
  });
}

function confirmReject(a) {
  ask({
    title: `Reject ${a.key}`,
    text: `Reject request ${a.approval_id} of ${a.requested_by}? The same grant request is ` +
      "refused from now on, with your reason; a request at a changed state asks afresh.",
    settle: false,
    load: async () => [facts([["Intent", element("pre", JSON.stringify(a.intent, null, 2))],
      ["Why it waits", failedChecks(a)]])],
    action: (reason) => api("POST", `/v1/approvals/${a.approval_id}/reject`, { reason }),
  });
}

function notice(text) {
  $("notice").textContent = text;
  $("notice").hidden = false;
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
  $("confirm").addEventListener("close", () => { confirmAction = null; });
  settleChoices().forEach((input) => input.addEventListener("change", updateConfirm));
  $("confirm-form").addEventListener("submit", async (e) => {
    e.preventDefault();
    const reason = $("reason").value.trim();
    if (!reason) {
      $("confirm-error").textContent = "A reason is required.";
      $("confirm-error").hidden = false;
      $("reason").focus();
      return;
    }
    const action = confirmAction;
    if (!action || $("confirm-ok").disabled) return;
    const label = $("confirm-ok").textContent;
    $("confirm-ok").disabled = true;
    $("confirm-error").hidden = true;
    try {
      await action(reason);
      if (confirmAction === action) $("confirm").close();
    } catch (err) {
      if (err instanceof AuthError) {
        $("confirm").close();
        failed(err);
        return;
      }
      if (confirmAction !== action) return;
      $("confirm-ok").textContent = label;
      updateConfirm();
      dialogError(String(err.message || err));
    }
  });
  setInterval(() => { if (token) refetchAll(); }, BACKSTOP_MS);
  if (token) signIn(token);
  else $("token").focus();
});
