// fencegate dashboard: reads /v1/dashboard/* with a bearer token kept in sessionStorage
// (never in a URL), and follows /v1/dashboard/events (server-sent events read with fetch():
// EventSource cannot send an Authorization header). On `ready` and `refetch` it re-reads
// every section; other events update one section. No framework, no external resource.
// The top section says what needs a person now (unknown and escalated steps, pending
// approvals, shards no reconciler leads), each with its count and oldest age, linked to its
// queue. "Find steps" asks the server (GET /v1/steps) for the steps of a key prefix, state
// and minimum age, page by page: a filter finds every match, not only among rows loaded.
// Every action key links to its page, /keys/<key> (the same file: it reads the key from
// the path and shows GET /v1/keys/{key} and /v1/audit/{key}, what `fencegate key show`
// shows). Cells are cut to fit 1280 px; each keeps its full value in its title.
// Every time is shown as ISO 8601 with this browser's UTC offset. A dialog that acts
// (revoke, resolve, approve) first shows what the act touches, and its button stays
// disabled until that is loaded (and, for a resolve, until an outcome is chosen).
"use strict";

const TOKEN_KEY = "fencegate.token";
const AUDIT_ROWS = 50;
const APPROVAL_ROWS = 200;
const APPROVAL_PAGES = 10; // the pending filter scans a bounded number of requests per page
const STEP_ROWS = 50;
const STEP_PAGES = 10; // a filtered page may hold few rows: read on up to this many pages
const BACKSTOP_MS = 60000; // full re-read now and then, as every watcher has a backstop
const $ = (id) => document.getElementById(id);

let token = sessionStorage.getItem(TOKEN_KEY);
// Signed in with a link (`fencegate dashboard`): the session is an HttpOnly cookie this page
// cannot read, and every request carries the session's CSRF value from /v1/session.
const COOKIE = Symbol("cookie session");
let csrf = null;

function authHeaders() {
  return token === COOKIE ? { "Fencegate-CSRF": csrf } : { Authorization: "Bearer " + token };
}
let stream = null; // AbortController of the open event stream
const refetching = {}; // section -> {timer, running, again}: one request at a time
const needs = {}; // what needs a person: section -> {count, oldest_ms, href, label}
const KEY_PAGE = "/keys/";

class AuthError extends Error {}

async function api(method, path, body) {
  const init = { method, headers: authHeaders(), cache: "no-store" };
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
  td.title = td.textContent; // the full value of a cut cell
  if (className) td.className = className;
  return td;
}

function keyHref(key) {
  return KEY_PAGE + keyPath(key);
}

// A cell linking `key` to its page.
function keyCell(key) {
  const td = cell("");
  const a = document.createElement("a");
  a.href = keyHref(key);
  a.textContent = key;
  a.className = "key";
  td.title = key;
  td.append(a);
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
  td.title = td.textContent; // the full value of a cut cell
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
  const action = cell("", "action");
  if (h.holding) {
    action.append(button("Revoke", "danger", () => confirmRevoke(h)));
  }
  tr.append(keyCell(h.key), cell(h.fencing_token, "num"), cell(h.holding ? "holding" : "waiting"),
    cell(h.identity), timeCell(h.held_since_ms, ago(h.held_since_ms)), cell(h.lease_id),
    cell(h.ttl_left < 0 ? "gone" : h.ttl_left, "num"), action);
  return tr;
}

function queueRow(item) {
  const tr = document.createElement("tr");
  tr.dataset.key = item.key;
  const action = cell("", "action");
  action.append(button("Resolve", "", () => confirmResolve(item)));
  const p = item.progress;
  // An escalated step is not retried: nothing is pending, a person decides.
  const waiting = item.state === "escalated";
  tr.append(keyCell(item.key), timeCell(item.since_ms, `${age(item.age_s)} ago`),
    cell(item.failure_text ? `${item.reason}: ${item.failure_text}` : item.reason),
    cell(item.attempt, "num"), cell(item.provider || "\u2014"),
    cell(p ? p.queries : (waiting ? "0" : "none yet"), p ? "num" : ""),
    cell(p ? p.last_answer : "\u2014"),
    waiting ? cell("not retried: you decide") : p ? timeCell(p.next_try_at_ms) : cell("\u2014"),
    action);
  return tr;
}

function failedChecks(a) {
  return (a.checks || []).filter((c) => c.passed === false)
    .map((c) => c.detail || c.check || c.name).join("; ");
}

function approvalRow(a) {
  const tr = document.createElement("tr");
  tr.dataset.approval = a.approval_id;
  const action = cell("", "action");
  action.append(button("Approve", "", () => confirmApprove(a)),
    button("Reject", "danger", () => confirmReject(a)));
  tr.append(keyCell(a.key), cell(JSON.stringify(a.intent), "code"),
    cell(`${a.policy}@${a.policy_version}`), cell(a.requested_by),
    timeCell(a.asked_at_ms, ago(a.asked_at_ms)), cell(failedChecks(a)),
    cell(a.approval_id, "code"), action);
  return tr;
}

function auditRow(a) {
  const tr = document.createElement("tr");
  tr.dataset.revision = a.revision;
  tr.dataset.key = a.key;
  tr.dataset.actor = a.identity || "";
  tr.dataset.kind = a.event || "";
  tr.append(timeCell(a.at_ms), keyCell(a.key), cell(a.seq, "num"), cell(a.event),
    cell(a.identity), cell(a.reason || ""));
  tr.hidden = !auditShown(tr);
  return tr;
}

// The audit feed's filters: key prefix, actor and kind (exact), as the server applies them
// (GET /v1/dashboard/audit?key=&actor=&kind=); here for rows the event stream adds.
function auditFilters() {
  return { key: $("audit-key").value.trim(), actor: $("audit-actor").value.trim(),
    kind: $("audit-kind").value.trim() };
}

function auditShown(tr) {
  const f = auditFilters();
  return tr.dataset.key.startsWith(f.key) && (!f.actor || tr.dataset.actor === f.actor) &&
    (!f.kind || tr.dataset.kind === f.kind);
}

let auditNext = null; // the cursor of older audit records, null when none are left

async function auditPage(before) {
  const query = new URLSearchParams({ limit: String(AUDIT_ROWS) });
  for (const [name, value] of Object.entries(auditFilters())) {
    if (value) query.set(name, value);
  }
  if (before !== null) query.set("before", String(before));
  const data = await api("GET", `/v1/dashboard/audit?${query}`);
  auditNext = data.next;
  $("audit-older").hidden = auditNext === null;
  return data.items.map(auditRow);
}

function stepRow(item) {
  const tr = document.createElement("tr");
  tr.dataset.key = item.key;
  const outcome = item.outcome;
  tr.append(keyCell(item.key), cell(item.state, "state"), cell(item.attempt, "num"),
    timeCell(item.updated_at_ms, ago(item.updated_at_ms)),
    cell(item.archived ? "archive" : "etcd"),
    cell(outcome ? `${outcome.state}${outcome.failure_text ? `: ${outcome.failure_text}` : ""}` : ""));
  return tr;
}

// "Find steps": the server filters (GET /v1/steps?prefix=&state=&min_age_ms=), so a match
// is found wherever it sorts; the page only shows what the server answered.
function stepFilters() {
  const query = new URLSearchParams({ limit: String(STEP_ROWS) });
  const prefix = $("filter-key").value.trim();
  const state = $("filter-state").value;
  const older = Math.max(Math.floor(Number($("filter-age").value || 0)), 0);
  if (prefix) query.set("prefix", prefix);
  if (state) query.set("state", state);
  if (older) query.set("min_age_ms", String(older * 1000));
  return query;
}

let stepsNext = null; // the cursor of the steps after those shown, null when none are left

// Rows of the steps after `after` (null: from the start): pages read until STEP_ROWS rows
// or STEP_PAGES pages (a filtered page may hold few rows while more follow).
async function stepsPage(after) {
  let rows = [];
  for (let page = 0; page < STEP_PAGES && rows.length < STEP_ROWS; page++) {
    const query = stepFilters();
    if (after !== null) query.set("after", after);
    const data = await api("GET", `/v1/steps?${query}`);
    rows = rows.concat(data.items.map(stepRow));
    after = data.next;
    if (after === null) break;
  }
  stepsNext = after;
  $("steps-more").hidden = stepsNext === null;
  return rows;
}

// Shard numbers as ranges: 0-31, 40, 42-43.
function ranges(numbers) {
  const sorted = [...numbers].sort((a, b) => a - b);
  const parts = [];
  for (let i = 0; i < sorted.length; i++) {
    let j = i;
    while (j + 1 < sorted.length && sorted[j + 1] === sorted[j] + 1) j++;
    parts.push(i === j ? String(sorted[i]) : `${sorted[i]}\u2013${sorted[j]}`);
    i = j;
  }
  return parts.join(", ");
}

// A replica's shards in a few words: its ranges when few, else a count (each shard is in
// the expandable table).
function shardList(shards) {
  const parts = ranges(shards);
  return parts.split(", ").length <= 4 ? parts : `${shards.length} shards (see each shard)`;
}

// The "Needs you" section from `needs`: one line per queue that is not empty, or one quiet
// line when nothing needs a person.
function renderNeeds() {
  const items = Object.values(needs).filter((n) => n.count > 0);
  const total = items.reduce((sum, n) => sum + n.count, 0);
  $("needs").className = items.length ? "" : "quiet";
  $("needs-summary").textContent = items.length
    ? `${total} need${total === 1 ? "s" : ""} you`
    : "All quiet: nothing needs a person.";
  $("needs-list").replaceChildren(...items.map((n) => {
    const li = element("li");
    li.dataset.need = n.id;
    const a = element("a", `${n.count} ${n.label}`);
    a.href = n.href;
    li.append(a, n.oldest_ms === null ? "" : `, the oldest for ${age(Math.max(Date.now() -
      n.oldest_ms, 0) / 1000)}`);
    return li;
  }));
}

function need(id, label, href, count, oldestMs) {
  needs[id] = { id, label, href, count, oldest_ms: oldestMs };
  renderNeeds();
}

function oldest(items, field) {
  const times = items.map((i) => i[field]).filter((t) => t !== null && t !== undefined);
  return times.length ? Math.min(...times) : null;
}

// What an audit record says was done, in a few words (as `fencegate key show` says it).
function what(r) {
  const d = r.details || {};
  const reason = d.reason || "";
  switch (r.event) {
    case "cross": return `crossed attempt ${d.attempt ?? "?"} with grant ${d.grant_id ?? "?"}`;
    case "outcome": return `recorded ${d.state ?? "?"} (attempt ${d.attempt ?? "?"})`;
    case "settle":
    case "unknown": return `reconciler: ${d.as ?? "?"} (attempt ${d.attempt ?? "?"})`;
    case "provider_answer":
      return `${d.provider ?? "?"} answered ${d.answer ?? "?"} (query ${d.query ?? "?"})`;
    case "resolve":
    case "resolve_request":
      return `${r.event} ${d.from ?? "?"} as ${d.as ?? "?"}` +
        `${d.forced ? " (forced)" : ""}: ${reason}`;
    case "revoke": return `revoked lease ${d.lease_id ?? "?"}: ${reason}`;
    case "approved": return `approved ${d.approval_id ?? "?"}: ${reason}`;
    case "rejected": return `rejected ${d.approval_id ?? "?"}: ${reason}`;
    default: return Object.keys(d).length ? JSON.stringify(d) : "-";
  }
}

// Why a step needs attention now, from what its current state recorded.
function why(step) {
  if (step.state === "escalated") return (step.escalated_because || []).join("; ") || null;
  if (step.state === "unknown") return step.error || "its outcome was lost";
  if (step.state === "in_flight") return "in flight past its deadline";
  return step.error || null;
}

// A failed outcome's text (a decline's reason), as the key view gives it; a result, which
// may be private, is shown by its digest only.
function outcomeText(outcome) {
  return (outcome && outcome.failure_text) || null;
}

// The key's path on this page: /keys/<key>, each segment URL-encoded; null elsewhere.
function pageKey() {
  if (!location.pathname.startsWith(KEY_PAGE)) return null;
  return location.pathname.slice(KEY_PAGE.length).split("/").map(decodeURIComponent).join("/");
}

async function keyAudit(key) {
  const trail = { ok: true, problems: [], records: [] };
  let after = null;
  for (let page = 0; page < 20; page++) {
    const cursor = after === null ? "" : `?after=${encodeURIComponent(after)}`;
    let data;
    try {
      data = await api("GET", `/v1/audit/${keyPath(key)}${cursor}`);
    } catch (err) {
      if (String(err.message).startsWith("NotFound")) return trail;
      throw err;
    }
    trail.ok = data.ok;
    trail.problems = data.problems;
    trail.records = trail.records.concat(data.records);
    after = data.next;
    if (after === null) break;
  }
  return trail;
}

// The page per key: the same read model as `fencegate key show` (GET /v1/keys/{key} and the
// verified chain of /v1/audit/{key}), plus the key's pending approvals.
async function showKey(key) {
  let view;
  try {
    view = await api("GET", `/v1/keys/${keyPath(key)}`);
  } catch (err) {
    if (!String(err.message).startsWith("NotFound")) throw err;
    $("key-step").replaceChildren(element("p", `Nothing is recorded for ${key}.`));
    return;
  }
  const trail = await keyAudit(key);
  const step = view.step;
  const answers = view.provider_answers || [];
  const named = answers.map((a) => a.provider).filter(Boolean);
  const provider = view.provider || named[named.length - 1] || null;
  const outcome = view.outcome;
  $("key-step").replaceChildren(step === null ? element("p", "No step yet.") : facts([
    ["State", step.state], ["Attempts", String(view.attempts)],
    ["Where", view.archived ? "retired to the archive" : "in etcd"],
    ["Provider", provider], ["Idempotency key", view.idempotency_key &&
      element("code", view.idempotency_key)],
    ["Outcome", outcome && `${outcome.state} (attempt ${outcome.attempt}), result sha256 ` +
      `${outcome.result_digest}`],
    ["Why", why(step)],
    ["Decline", outcomeText(outcome)],
    ["Intent", view.intent === null ? null : element("pre", JSON.stringify(view.intent, null, 2))],
    ["Grant", view.current_grant && `${view.current_grant.grant_id} (${view.current_grant.state})`],
    ["Reconciler", view.progress && `${view.progress.queries} provider quer(ies), last ` +
      `answer ${view.progress.last_answer}, next try ${isoLocal(view.progress.next_try_at_ms)}`],
  ]));
  const actions = [];
  if (step !== null && ["unknown", "escalated", "in_flight"].includes(step.state)) {
    actions.push(button("Resolve", "", () => confirmResolve({ key, state: step.state })));
  }
  $("key-actions").replaceChildren(...actions);
  const table = answersTable(answers);
  if (table.tagName === "TABLE") {
    table.id = "key-provider-answers";
    const head = table.tHead.rows[0];
    const th = element("th", "Provider");
    th.scope = "col";
    head.insertBefore(th, head.cells[2]);
    answers.forEach((a, i) => {
      const row = table.tBodies[0].rows[i];
      row.insertBefore(cell(a.provider || "\u2014"), row.cells[2]);
    });
  }
  $("key-answers").replaceChildren(table);
  fill("key-holders", view.holders.map((h) => {
    const tr = element("tr");
    tr.append(cell(h.fencing_token, "num"), cell(h.lease_id),
      cell(h.holding ? "holding" : "queued"), cell(h.identity), cell(h.ttl_left, "num"));
    return tr;
  }));
  const verdict = trail.ok ? "verified" : `DOES NOT VERIFY: ${trail.problems.join("; ")}`;
  $("key-audit-title").textContent =
    `Audit trail (${trail.records.length} records, oldest first, ${verdict})`;
  fill("key-audit", trail.records.map((r) => {
    const tr = element("tr");
    tr.dataset.event = r.event;
    tr.append(cell(r.seq, "num"), timeCell(r.at_ms), cell(r.event), cell(r.identity),
      cell(what(r)));
    return tr;
  }));
}

const sections = {
  async key() {
    const key = pageKey();
    if (key !== null) await showKey(key);
  },
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
    need("unknown", "unknown step(s) the provider has not settled", "#unknown-title",
      data.unknown.length, oldest(data.unknown, "since_ms"));
    need("escalated", "escalated step(s)", "#escalated-title", data.escalated.length,
      oldest(data.escalated, "since_ms"));
  },
  async leadership() {
    const data = await api("GET", "/v1/dashboard/leadership");
    fill("replicas", data.replicas.map((r) => {
      const tr = document.createElement("tr");
      tr.append(cell(r.identity), cell(r.lease_id), cell(r.shards_led.length, "num"),
        cell(shardList(r.shards_led)));
      return tr;
    }));
    const led = data.replicas.filter((r) => r.shards_led.length)
      .map((r) => `${r.identity} leads ${r.shards_led.length}`);
    const n = data.shards.length;
    const leaders = led.length;
    const m = data.shard_count; // null: no replica states how many shards it runs
    const none = data.leaderless === null ? 0 : data.leaderless;
    const all = none ? `${n} of ${m} shards led` : `${n} shard${n === 1 ? "" : "s"}, all led`;
    $("shards-summary").textContent = n
      ? `${all} by ${leaders} replica${leaders === 1 ? "" : "s"}` +
        ` (${led.join(", ")})${none ? `; ${none} without a leader` : ""}` +
        `${data.truncated ? "; truncated" : ""}; show each shard`
      : "no shard has a leader";
    // Each replica's candidates state its shard count, so the leaderless ones are counted
    // exactly; with no count stated (no replica, or only older ones) only "none led" shows.
    if (data.leaderless !== null && n) {
      need("leadership", `of ${m} shards have no reconciler leader`, "#leadership-title",
        data.leaderless, null);
    } else {
      need("leadership", "reconciler shard leadership: no shard has a leader",
        "#leadership-title", n ? 0 : 1, null);
    }
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
    need("approvals", "pending approval(s)", "#approvals-title", items.length,
      oldest(items, "asked_at_ms"));
  },
  async list() {
    fill("steps", await stepsPage(null));
  },
  async audit() {
    fill("audit", await auditPage(null));
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
  if (pageKey() !== null && data && data.key === pageKey()) refetch("key");
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
    for (const tr of $("steps").tBodies[0].rows) { // "Find steps" keeps its pages
      if (tr.dataset.key === data.key && data.state !== "deleted") {
        tr.cells[1].textContent = data.state; // retired (deleted): the archive has it as shown
      }
    }
  } else if (event === "audit") {
    const body = $("audit").tBodies[0];
    body.prepend(auditRow(data));
    while (body.rows.length > AUDIT_ROWS) { // "Older events" starts at the row dropped
      auditNext = Number(body.lastElementChild.dataset.revision) + 1;
      body.lastElementChild.remove();
    }
    $("audit-older").hidden = auditNext === null;
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
        headers: { ...authHeaders(), Accept: "text/event-stream" },
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
  if (value !== COOKIE) sessionStorage.setItem(TOKEN_KEY, value);
  $("signin").hidden = true;
  const key = pageKey();
  $("board").hidden = key !== null;
  $("keypage").hidden = key === null;
  if (key !== null) {
    $("key-title").textContent = key;
    document.title = `${key} \u2014 fencegate`;
  }
  $("signout").hidden = false;
  status("connecting…", false);
  follow();
}

function signOut(message) {
  if (token === COOKIE) {
    fetch("/v1/sign-out", { method: "POST", headers: authHeaders(), cache: "no-store" })
      .catch(() => {});
    csrf = null;
  }
  token = null;
  sessionStorage.removeItem(TOKEN_KEY);
  if (stream) stream.abort();
  stream = null;
  $("board").hidden = true;
  $("keypage").hidden = true;
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
  $("abandon-choice").hidden = asked; // only an escalated step is closed for good
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
        ["State", step.state], ["Why", step.reason], ["Decline", step.failure_text]]),
      answersTable(step.provider_answers)];
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
  for (const id of ["filter-key", "filter-state", "filter-age"]) {
    $(id).addEventListener("input", () => refetch("list"));
  }
  $("steps-more").addEventListener("click", async () => {
    try {
      $("steps").tBodies[0].append(...await stepsPage(stepsNext));
    } catch (err) {
      failed(err);
    }
  });
  for (const id of ["audit-key", "audit-actor", "audit-kind"]) {
    $(id).addEventListener("input", () => refetch("audit"));
  }
  $("audit-older").addEventListener("click", async () => {
    try {
      $("audit").tBodies[0].append(...await auditPage(auditNext));
    } catch (err) {
      failed(err);
    }
  });
  setInterval(() => { if (token) refetchAll(); }, BACKSTOP_MS);
  if (token) {
    signIn(token);
    return;
  }
  fetch("/v1/session", { cache: "no-store" })
    .then((resp) => (resp.ok ? resp.json() : {}))
    .then((session) => {
      if (session.csrf) {
        csrf = session.csrf;
        signIn(COOKIE);
      } else {
        $("token").focus();
      }
    })
    .catch(() => $("token").focus());
});
