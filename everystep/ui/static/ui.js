// everystep operators' UI: plain JavaScript, no dependencies.
"use strict";

const meta = (name) => document.querySelector(`meta[name="everystep-${name}"]`).content;
const BASE = meta("base");
const ROLE = meta("role");
const CSRF = { [meta("csrf-header")]: meta("csrf-token") };
const STATUSES = ["scheduled", "waiting", "running", "blocked", "completed", "failed", "stopped", "cancelled"];
const main = document.getElementById("main");

// ------------------------------------------------------------------ helpers

function h(tag, attrs = {}, ...children) {
  const el = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === null || v === undefined || v === false) continue;
    if (k.startsWith("on")) el.addEventListener(k.slice(2), v);
    else if (k === "class") el.className = v;
    else el.setAttribute(k, v === true ? "" : v);
  }
  for (const c of children.flat(Infinity)) {
    if (c === null || c === undefined || c === false) continue;
    el.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
  return el;
}

// replaceChildren, skipping null/false and flattening arrays as h() does.
function fill(el, ...children) {
  el.replaceChildren(...children.flat(Infinity).filter((c) => c !== null && c !== undefined && c !== false));
}

async function getJSON(path) {
  const res = await fetch(BASE + path, { credentials: "same-origin", headers: { Accept: "application/json" } });
  const body = await res.json().catch(() => ({ error: res.statusText }));
  if (!res.ok) throw new Error(body.error || res.statusText);
  return body;
}

async function act(action, body) {
  const res = await fetch(`${BASE}/api/actions/${action}`, {
    method: "POST", credentials: "same-origin",
    headers: { "Content-Type": "application/json", ...CSRF }, body: JSON.stringify(body),
  });
  const answer = await res.json().catch(() => ({ error: res.statusText }));
  if (!res.ok) throw new Error(answer.error || res.statusText);
  return answer;
}

function flash(text, bad = false) {
  const el = document.getElementById("flash");
  el.textContent = text;
  el.className = bad ? "bad" : "good";
  el.hidden = false;
  clearTimeout(flash.timer);
  flash.timer = setTimeout(() => { el.hidden = true; }, 8000);
}

async function confirmed(question, action, body) {
  if (!window.confirm(question)) return null;
  try {
    const answer = await act(action, body);
    flash(answer.message + (answer.refused && answer.refused.length ? ": " + answer.refused.join("; ") : ""));
    refresh();
    return answer;
  } catch (err) {
    flash(err.message, true);
    return null;
  }
}

const when = (t) => (t ? new Date(t).toISOString().replace("T", " ").replace(/\.\d+Z$/, "Z") : "-");
const whenMs = (t) => (t ? new Date(t).toISOString().replace("T", " ") : "-");
const badge = (status) => h("span", { class: `status ${status}` }, status);
const runLink = (id, text) => h("a", { href: `#run/${id}`, class: "mono" }, text || id);

// everystep's extended JSON, shown readably: {"$es": "date", "v": ...} -> date 2026-01-02
function readable(v, indent = "") {
  if (v === null || typeof v !== "object") return JSON.stringify(v);
  const inner = indent + "  ";
  if (!Array.isArray(v) && typeof v.$es === "string") {
    const t = v.$es;
    if (t === "datetime" || t === "date" || t === "time" || t === "uuid") return `${t}(${v.v})`;
    if (t === "decimal") return `Decimal(${v.v})`;
    if (t === "timedelta") return `timedelta(days=${v.v[0]}, seconds=${v.v[1]}, microseconds=${v.v[2]})`;
    if (t === "bytes") return `bytes[${Math.floor((v.v.length * 3) / 4)}](${v.v.length > 60 ? v.v.slice(0, 60) + "…" : v.v})`;
    if (t === "enum") return `${v.cls}(${readable(v.v, indent)})`;
    if (t === "tuple") return "(" + v.v.map((x) => readable(x, indent)).join(", ") + (v.v.length === 1 ? ",)" : ")");
    if (t === "dict") return readable(v.v, indent);
  }
  if (Array.isArray(v)) {
    if (!v.length) return "[]";
    return "[\n" + v.map((x) => inner + readable(x, inner)).join(",\n") + "\n" + indent + "]";
  }
  const keys = Object.keys(v);
  if (!keys.length) return "{}";
  return "{\n" + keys.map((k) => `${inner}${JSON.stringify(k)}: ${readable(v[k], inner)}`).join(",\n") + "\n" + indent + "}";
}

function describeError(e) {
  if (!e || typeof e !== "object" || !e.type) return readable(e);
  return `${e.type}: ${e.message || ""}` + (e.args && e.args.length && !(e.args.length === 1 && e.args[0] === e.message)
    ? `\nargs: ${readable(e.args)}` : "");
}

// ------------------------------------------------------------------ live updates

const live = { version: -1, snapshot: null, changes: null, mode: "connecting", source: null, failures: 0 };

function setIndicator(mode) {
  live.mode = mode;
  const el = document.getElementById("indicator");
  el.className = `indicator ${mode}`;
  el.textContent = mode;
  el.dataset.mode = mode;
}

function receive(snapshot) {
  if (snapshot.database === "down") {
    setIndicator("disconnected");
    return;
  }
  const changed = live.changes !== null && live.changes !== snapshot.changes;
  live.snapshot = snapshot;
  live.version = snapshot.version;
  live.changes = snapshot.changes;
  onSnapshot(snapshot, changed);
}

function connect() {
  if (!window.EventSource) return poll();
  const source = new EventSource(`${BASE}/api/events`);
  live.source = source;
  source.addEventListener("overview", (ev) => {
    live.failures = 0;
    setIndicator("live");
    receive(JSON.parse(ev.data));
  });
  source.onerror = () => {
    live.failures += 1;
    if (live.failures >= 3) {  // the stream does not get through (a proxy, say): poll instead
      source.close();
      live.source = null;
      poll();
    } else setIndicator("disconnected");
  };
}

async function poll() {
  try {
    receive(await getJSON("/api/overview"));
    if (live.mode !== "disconnected" || live.snapshot) setIndicator("polling");
  } catch (err) {
    setIndicator("disconnected");
  }
  setTimeout(poll, 2000);
}

// A filtered list or a run's page asks again only when the database changed,
// at most every 2 s.
let refetchTimer = null;
function refetchSoon() {
  if (refetchTimer) return;
  refetchTimer = setTimeout(() => { refetchTimer = null; refresh(true); }, 2000);
}

// ------------------------------------------------------------------ routing

let current = { view: "runs" };
let onSnapshot = () => {};

// The page's state is in its URL (shareable; the back button works): the
// hash is a view and its parameters, "#?status=failed&workflow=x" (the runs
// list), "#run/ID", "#charts?workflow=x&window=day", "#schedule/KEY".
function parseHash() {
  const hash = location.hash.slice(1);
  const at = hash.indexOf("?");
  return { path: decodeURIComponent(at < 0 ? hash : hash.slice(0, at)), params: new URLSearchParams(at < 0 ? "" : hash.slice(at + 1)) };
}

function go(hash) {
  if (location.hash.slice(1) === hash) refresh();
  else location.hash = hash;
}

function route() {
  const { path: hash, params } = parseHash();
  const path = location.pathname.slice(BASE.length);
  let m;
  if ((m = hash.match(/^run\/(.+)$/))) current = { view: "run", id: m[1] };
  else if (!hash && !params.toString() && (m = path.match(/^\/runs\/(.+)$/))) current = { view: "run", id: m[1] };
  else if ((m = hash.match(/^schedule\/(.+)$/))) current = { view: "fires", key: m[1] };
  else if ((m = hash.match(/^dag\/(.+)$/))) current = { view: "dag", key: m[1] };
  else if (hash === "dags") current = { view: "dags", status: params.get("status") || "" };
  else if (hash === "charts") current = { view: "charts", workflow: params.get("workflow") || "", window: params.get("window") || "hour" };
  else if (["schedules", "workers", "failures", "audit"].includes(hash)) current = { view: hash };
  else {
    current = { view: "runs" };
    for (const k of Object.keys(filters)) filters[k] = params.get(k) || "";
  }
  document.querySelectorAll("nav a").forEach((a) => a.classList.toggle("active", a.dataset.view === current.view));
  onSnapshot = () => {};
  clearTimeout(refetchTimer);  // a refetch the previous view asked for would draw this one again
  refetchTimer = null;
  refresh();
}

function refresh(quiet = false) {
  const views = { runs: showRuns, run: showRun, schedules: showSchedules, workers: showWorkers, failures: showFailures,
    audit: showAudit, charts: showCharts, fires: showFires, dags: showDags, dag: showDag };
  views[current.view](quiet).catch((err) => { if (!quiet) fill(main, h("p", { class: "error" }, err.message)); });
}

window.addEventListener("hashchange", route);
document.getElementById("open-run").addEventListener("submit", (ev) => {
  ev.preventDefault();
  const id = ev.target.id.value.trim();
  if (id) location.hash = `run/${id}`;
});

// ------------------------------------------------------------------ runs

const filters = { status: "", workflow: "", since: "", until: "", attr: "", q: "" };
let listState = { runs: [], next: null, selected: new Set(), pages: 1 };

// The from/to inputs are read in UTC, like every time on these pages.
const utc = (v) => (/(Z|[+-]\d\d:\d\d)$/.test(v) ? v : `${v}Z`);

function filterQuery() {
  const p = new URLSearchParams();
  for (const [k, v] of Object.entries(filters)) if (v) p.set(k, k === "since" || k === "until" ? utc(v) : v);
  return p;
}

// The filters as the page's URL keeps them (times as typed, in UTC).
function filterHash() {
  const p = new URLSearchParams();
  for (const [k, v] of Object.entries(filters)) if (v) p.set(k, v);
  return p.toString() ? `?${p}` : "";
}
const unfiltered = () => !Object.values(filters).some(Boolean);

async function showRuns(quiet) {
  const asked = current;
  if (!quiet || !document.getElementById("runs-table")) await buildRunsPage();
  if (current !== asked) return;  // the page moved on meanwhile: drawing this would cover the new view
  if (unfiltered() && live.snapshot && listState.pages <= 1) {
    listState.runs = live.snapshot.runs;
    listState.next = live.snapshot.runs.length >= 50 ? cursorOf(live.snapshot.runs) : null;
  } else {
    const answer = await getJSON(`/api/runs?${filterQuery()}`);
    if (current !== asked) return;
    listState.runs = answer.runs;
    listState.next = answer.next;
  }
  listState.pages = 1;
  renderRows();
  onSnapshot = (snapshot, changed) => {
    renderCounts(snapshot);
    if (unfiltered() && listState.pages <= 1) {
      listState.runs = snapshot.runs;
      listState.next = snapshot.runs.length >= 50 ? cursorOf(snapshot.runs) : null;
      renderRows();
    } else if (changed) refetchSoon();
  };
  if (live.snapshot) renderCounts(live.snapshot);
}

const cursorOf = (runs) => `${runs[runs.length - 1].created_at}|${runs[runs.length - 1].id}`;

async function buildRunsPage() {
  const asked = current;
  const names = await getJSON("/api/workflows").catch(() => ({ workflows: [] }));
  if (current !== asked) return;
  const input = (name, attrs) => h("input", { name, value: filters[name], ...attrs });
  const form = h("form", { id: "filters", class: "filters", onsubmit: (ev) => {
    ev.preventDefault();
    const since = ev.target.since.value, until = ev.target.until.value;
    if (since && until && since > until) return flash(`from (${since.replace("T", " ")} UTC) is after to (${until.replace("T", " ")} UTC): nothing can match`, true);
    for (const k of Object.keys(filters)) filters[k] = ev.target[k].value.trim();
    listState.selected.clear();
    go(filterHash());
  } },
    h("select", { name: "status", "aria-label": "status" }, h("option", { value: "" }, "any status"),
      STATUSES.map((s) => h("option", { value: s, selected: filters.status === s }, s))),
    h("select", { name: "workflow", "aria-label": "workflow" }, h("option", { value: "" }, "any workflow"),
      names.workflows.map((n) => h("option", { value: n, selected: filters.workflow === n }, n))),
    h("label", {}, "from ", input("since", { type: "datetime-local" }), " UTC"),
    h("label", {}, "to ", input("until", { type: "datetime-local" }), " UTC"),
    input("attr", { type: "search", size: 24, placeholder: "attributes: tenant=acme,order=42", "aria-label": "attributes" }),
    input("q", { type: "search", size: 40, placeholder: "run id, idempotency key, or args JSON {\"k\": 1}", "aria-label": "search" }),
    h("button", {}, "Filter"),
    h("button", { type: "button", onclick: () => { Object.keys(filters).forEach((k) => { filters[k] = ""; }); go(""); } }, "Clear"),
    // Acts on what the filter finds, not on a selection: shown to operators whatever is selected.
    ROLE === "operator" ? h("button", { type: "button", id: "bulk-open", onclick: () => bulkByFilter() }, "Bulk action on the filter…") : null);
  const bulk = ROLE === "operator" ? h("div", { class: "bulk", id: "bulk", hidden: true },
    h("span", { id: "selection" }, ""),
    h("button", { onclick: () => bulkAct("requeue", "Requeue the selected runs whose claimer is dead?", false) }, "Requeue selected"),
    h("button", { onclick: () => bulkAct("reschedule", "Schedule the selected runs again with the same args?", false) }, "Schedule selected again"),
    h("button", { onclick: () => bulkAct("requeue", "Requeue EVERY run matching the filter whose claimer is dead?", true) }, "Requeue all matching"),
    h("button", { onclick: () => bulkAct("reschedule", "Schedule EVERY run matching the filter again?", true) }, "Schedule all matching again"),
    h("button", { onclick: () => bulkAct("cancel", "Cancel the selected runs?", false) }, "Cancel selected"),
    h("button", { onclick: () => bulkAct("cancel", "Cancel EVERY run matching the filter?", true) }, "Cancel all matching"),
    h("button", { onclick: () => bulkRerun() }, "Re-run selected from a step"),
  ) : null;
  fill(main, 
    h("section", { id: "counts", class: "counts" }),
    h("section", { id: "runners", class: "runners" }),
    form, bulk,
    h("table", { id: "runs-table" }, h("thead", {}, h("tr", {},
      h("th", {}, ROLE === "operator" ? h("input", { type: "checkbox", "aria-label": "select all", onchange: (ev) => {
        listState.selected = new Set(ev.target.checked ? listState.runs.map((r) => r.id) : []);
        renderRows();
      } }) : ""),
      ["run", "workflow", "status", "runner", "steps", "progress", "scheduled (UTC)", "finished (UTC)", "duration"].map((t, i) => h("th", { class: [3, 4, 7, 8].includes(i) ? "narrow-hide" : null }, t)))),
    h("tbody", { id: "runs" })),
    h("p", {}, h("button", { id: "more", onclick: loadMore }, "Older runs")),
  );
}

async function bulkAct(action, question, everything) {
  let body;
  if (everything) {
    const f = Object.fromEntries(filterQuery());
    if (!Object.keys(f).length && !window.confirm("No filter is set: this applies to every run. Continue?")) return;
    body = { filter: f };
  } else {
    if (!listState.selected.size) return flash("select runs first", true);
    body = { runs: [...listState.selected] };
  }
  if (await confirmed(question, action, body)) listState.selected.clear();
}

// A bulk action on every run the filter finds (status, workflow, times,
// attributes): preview the count and the newest 20, then confirm by typing
// the count (operations.bulk: chunks, resumable, audited).
function bulkByFilter() {
  const f = Object.fromEntries(filterQuery());
  delete f.q;
  if (!Object.keys(f).length) return flash("set a filter first (status, workflow, times or attributes): a bulk action never takes every run", true);
  const old = document.getElementById("bulk-panel");
  if (old) old.remove();
  const field = (name, attrs) => h("input", { name, ...attrs });
  const form = h("form", { id: "bulk-panel", class: "bulk-panel", onsubmit: (ev) => ev.preventDefault() },
    h("h3", {}, "Bulk action on ", h("span", { class: "mono" }, Object.entries(f).map(([k, v]) => `${k}=${v}`).join(" "))),
    h("select", { name: "action", "aria-label": "bulk action" },
      [["cancel", "cancel"], ["requeue", "requeue (claimer dead)"], ["rerun", "re-run from a step"], ["resolve-step", "resolve a started step"]]
        .map(([v, t]) => h("option", { value: v }, t))),
    field("reason", { placeholder: "reason (cancel)", size: 18 }),
    field("from_step", { placeholder: "from step (re-run)", size: 14 }),
    field("step", { placeholder: "step id (resolve)", size: 12 }),
    h("select", { name: "outcome", "aria-label": "outcome" }, ["", "result", "error", "discard"].map((o) => h("option", { value: o }, o || "outcome (resolve)"))),
    field("value", { placeholder: "result JSON or error message", size: 22 }),
    h("button", { id: "bulk-preview", type: "button", onclick: () => preview() }, "Preview"),
    h("div", { id: "bulk-found" }),
    h("label", {}, "type the number of runs to confirm ", field("confirm", { id: "bulk-confirm", size: 8, autocomplete: "off" })),
    h("button", { id: "bulk-apply", type: "button", disabled: true, onclick: () => apply() }, "Apply"),
    h("button", { type: "button", onclick: () => form.remove() }, "Close"));
  let count = null;
  const body = () => {
    const b = { filter: f };
    for (const k of ["action", "reason", "from_step", "step", "outcome", "value"]) if (form[k].value) b[k] = form[k].value;
    return b;
  };
  async function preview() {
    try {
      const answer = await act("bulk-preview", body());
      count = answer.count;
      document.getElementById("bulk-found").replaceChildren(
        h("p", { id: "bulk-count" }, `${answer.count} run(s) found`),
        h("ul", { class: "sample" }, answer.sample.map((id) => h("li", {}, runLink(id)))));
      form.confirm.value = "";
      form.querySelector("#bulk-apply").disabled = true;
    } catch (err) { flash(err.message, true); }
  }
  form.confirm.addEventListener("input", () => {
    form.querySelector("#bulk-apply").disabled = count === null || form.confirm.value.trim() !== String(count);
  });
  async function apply() {
    try {
      const answer = await act("bulk", { ...body(), confirm: form.confirm.value.trim() });
      flash(answer.message);
      form.remove();
      refresh();
    } catch (err) { flash(err.message, true); }
  }
  document.querySelector(".bulk").after(form);
}

async function bulkRerun() {
  if (!listState.selected.size) return flash("select runs first", true);
  const step = window.prompt("Re-run the selected runs from which step id? (the steps before it are copied, it and what follows run again)", "");
  if (!step) return;
  if (await confirmed(`Re-run ${listState.selected.size} run(s) from step ${step}?`, "rerun", { runs: [...listState.selected], from_step: step })) listState.selected.clear();
}

async function loadMore() {
  if (!listState.next) return;
  const p = filterQuery();
  p.set("before", listState.next);
  const answer = await getJSON(`/api/runs?${p}`);
  listState.runs = listState.runs.concat(answer.runs);
  listState.next = answer.next;
  listState.pages = (listState.pages || 1) + 1;
  renderRows();
}

function renderRows() {
  const body = document.getElementById("runs");
  if (!body) return;
  body.replaceChildren(...listState.runs.map((r) => {
    const total = r.steps_total || 0;
    const pct = r.status === "completed" ? 100 : total ? Math.round((100 * r.steps_done) / total) : 0;
    return h("tr", { "data-run": r.id, "data-status": r.status },
      h("td", {}, ROLE === "operator" ? h("input", { type: "checkbox", checked: listState.selected.has(r.id), "aria-label": "select",
        onchange: (ev) => { ev.target.checked ? listState.selected.add(r.id) : listState.selected.delete(r.id); renderSelection(); } }) : ""),
      h("td", {}, runLink(r.id, r.id.slice(0, 8) + "…" + r.id.slice(-4))),
      h("td", { class: "mono wf" }, r.name), h("td", {}, badge(r.status)),
      h("td", { class: "mono narrow-hide" }, r.claimed_by || "-"),
      h("td", { class: "narrow-hide" }, `${r.steps_done || 0} / ${total}`),
      h("td", {}, h("span", { class: `bar-track ${r.status}`, role: "progressbar", "aria-valuenow": pct, "aria-valuemin": 0, "aria-valuemax": 100, title: `${r.steps_done || 0} of ${total} steps done` },
        h("span", { class: "bar-fill", style: `width:${pct}%` }))),
      h("td", {}, when(r.created_at)), h("td", { class: "narrow-hide" }, when(r.completed_at)),
      h("td", { class: "duration narrow-hide" }, runDuration(r)));
  }));
  if (!listState.runs.length) body.append(h("tr", {}, h("td", { colspan: 10, class: "empty" }, "no runs match")));
  document.getElementById("more").hidden = !listState.next;
  renderSelection();
}

function renderSelection() {
  const el = document.getElementById("selection");
  if (el) el.textContent = listState.selected.size ? `${listState.selected.size} selected` : "";
  const bulk = document.getElementById("bulk");
  if (bulk) bulk.hidden = !listState.selected.size;  // the actions act on a selection: shown with one
}

// From scheduled to finished; a run not finished yet: so far, with "…".
function runDuration(r) {
  const end = r.completed_at ? Date.parse(r.completed_at) : Date.now();
  const ms = Math.max(end - Date.parse(r.created_at), 0);
  return humanMs(ms) + (r.completed_at || TERMINAL.includes(r.status) ? "" : " …");
}
const humanMs = (ms) => (ms < 1000 ? `${Math.round(ms)} ms` : ms < 60000 ? `${(ms / 1000).toFixed(1)} s`
  : ms < 3600000 ? `${Math.floor(ms / 60000)} min ${Math.round((ms % 60000) / 1000)} s`
  : ms < 86400000 ? `${Math.floor(ms / 3600000)} h ${Math.round((ms % 3600000) / 60000)} min` : `${(ms / 86400000).toFixed(1)} d`);

function renderCounts(snapshot) {
  const counts = document.getElementById("counts");
  if (counts && snapshot.counts) {
    counts.replaceChildren(...STATUSES.map((s) => {
      const c = snapshot.counts[s] || { n: 0, exact: true };
      return h("a", { href: "#", class: `count ${s}${filters.status === s ? " active" : ""}`, "data-status": s,
        title: c.exact ? "exact" : "estimate from the planner's statistics",
        onclick: (ev) => { ev.preventDefault(); filters.status = filters.status === s ? "" : s; go(filterHash()); } },
        h("b", {}, (c.exact ? "" : "≈") + c.n.toLocaleString("en")), " ", s);
    }));
  }
  const runners = document.getElementById("runners");
  if (runners && snapshot.runners) {
    const names = Object.keys(snapshot.runners).sort();
    fill(runners, h("b", {}, "in flight: "),
      names.length ? names.map((n) => h("span", { class: "runner mono" }, `${n} (${snapshot.runners[n]})`)) : "no runner has work in flight");
  }
}

// ------------------------------------------------------------------ a run

const TERMINAL = ["completed", "failed", "stopped", "cancelled"];
const short = (id) => `${id.slice(0, 8)}…${id.slice(-4)}`;
const epochWhen = (t) => (t === null || t === undefined ? "-" : whenMs(new Date(t * 1000).toISOString()));

async function showRun(quiet) {
  const asked = current;
  const run = await getJSON(`/api/runs/${encodeURIComponent(current.id)}`);
  if (current !== asked) return;  // the page moved on meanwhile (an action's refresh, then a link)
  const field = (label, value, id) => [h("dt", {}, label), h("dd", { id }, value)];
  const graph = h("div", { class: "graph", id: "graph" });
  const detail = h("div", { id: "step-detail", class: "step-detail" }, h("p", { class: "muted" }, "click a step to see its args, result or error"));
  const actions = ROLE === "operator" ? h("p", { class: "actions" },
    // Requeue only helps a run whose claimer is dead: its lock is free.
    run.status === "running" && run.claimer_alive === false
      ? h("button", { id: "requeue", onclick: () => confirmed(`Requeue run ${run.id}? Its claimer ${run.claimed_by} holds no lock: it is dead.`, "requeue", { runs: [run.id] }) }, "Requeue (claimer dead)") : null,
    h("button", { onclick: async () => {
      const answer = await confirmed(`Schedule a new run of ${run.name} with the same args?`, "reschedule", { runs: [run.id] });
      if (answer && answer.done.length) location.hash = `run/${answer.done[0]}`;
    } }, "Schedule again"),
    ["scheduled", "waiting", "running", "blocked"].includes(run.status)
      ? h("button", { onclick: () => confirmed(`Cancel run ${run.id}?` + (run.status === "running" ? " It stops at its next step." : ""), "cancel", { runs: [run.id] }) }, "Cancel")
      : null) : null;
  const links = (ids) => (ids && ids.length ? ids.map((id, i) => [i ? ", " : "", runLink(id, short(id))]) : "-");
  const page = h("article", { class: "run", "data-status": run.status },
    h("h2", {}, "run ", h("span", { class: "mono" }, run.id), " ", badge(run.status)),
    run.resolve ? resolvePanel(run) : null,
    actions,
    h("dl", {}, field("workflow", h("span", { class: "mono" }, run.name)), field("claimed by", run.claimed_by || "-"),
      run.status === "running" && run.claimed_by ? field("claimer", run.claimer_alive ? "alive (holds its lock)" : "dead (its lock is free)", "claimer-state") : null,
      field("idempotency key", run.idempotency_key || "-"),
      field("priority", run.priority === undefined ? "-" : String(run.priority)),
      field("concurrency key", run.concurrency_key || "-"), field("scheduled", when(run.created_at)),
      run.attributes ? field("attributes", Object.entries(run.attributes).map(([k, v], i) => [i ? " " : "",
        h("a", { class: "attribute mono", href: `#?${new URLSearchParams({ attr: `${k}=${typeof v === "string" ? v : JSON.stringify(v)}` })}` }, `${k}=${typeof v === "string" ? v : JSON.stringify(v)}`)]), "attributes") : null,
      !TERMINAL.includes(run.status) ? field(run.status === "waiting" ? "wakes" : "due", when(run.due_at), "due-at") : null,
      run.waiting_on ? field("waiting for", h("span", { class: "mono" }, run.waiting_on), "waiting-on") : null,
      field("finished", when(run.completed_at)),
      run.deadline_at ? field("deadline", h("span", { id: "run-deadline" }, when(run.deadline_at))) : null,
      run.cancel_requested_at || run.cancel_reason
        ? field("cancel", [h("span", { id: "run-cancel" }, run.cancel_reason ? `reason: ${run.cancel_reason}` : "requested"),
                           run.cancel_requested_at ? [" at ", when(run.cancel_requested_at)] : null], "cancel-request") : null,
      stepTimeouts(run) ? field("timeouts", h("span", { id: "run-timeouts" }, `${stepTimeouts(run)} step attempt(s) timed out`)) : null,
      run.dag ? field("graph", [h("a", { href: `#dag/${encodeURIComponent(run.dag.key)}`, id: "run-dag" }, run.dag.key), " member ", h("span", { class: "mono" }, run.dag.member)], "dag") : null,
      run.parent_id ? field("parent", runLink(run.parent_id, short(run.parent_id)), "parent") : null,
      run.children && run.children.length ? field("children", run.children.map((c, i) => [i ? " " : "", runLink(c.id, short(c.id)), " ", badge(c.status)]), "children") : null,
      run.rerun_of ? field("re-run of", runLink(run.rerun_of, short(run.rerun_of)), "rerun-of") : null,
      run.reruns && run.reruns.length ? field("re-runs", links(run.reruns), "reruns") : null,
      run.crashes ? field("crashes", run.crashes) : null),
    ROLE === "operator" && ["failed", "stopped", "cancelled"].includes(run.status) && run.steps.length ? rerunPanel(run) : null,
    ROLE === "operator" && !TERMINAL.includes(run.status) ? sendPanel(run) : null,
    h("h3", {}, "args"), h("pre", { class: "value" }, readable(run.args)),
    run.status === "completed" ? [h("h3", {}, "result"), h("pre", { class: "value", id: "run-result" }, readable(run.result))] : null,
    run.error ? [h("h3", {}, "error"), h("pre", { class: "value error", id: "run-error" }, describeError(run.error)), runTraceback(run)] : null,
    h("h3", {}, `steps (${run.steps.length})`),
    h("div", { class: "graph-tools" },
      h("button", { onclick: () => zoom(1.25) }, "+"), h("button", { onclick: () => zoom(0.8) }, "−"),
      h("button", { onclick: fit }, "fit"), h("span", { class: "legend" },
        ["done", "failed", "inflight", "waiting", "uncertain", "unreached"].map((st) => h("span", { class: `key ${st}` }, LEGEND[st])))),
    h("div", { class: "graph-and-detail" }, graph, detail),
    h("h3", {}, "timeline"), timeline(run),
    h("h3", {}, `executions (${run.execution_history.length})`), executionTable(run),
    run.messages && run.messages.length ? [h("h3", {}, `messages received (${run.messages.length})`), messageTable(run.messages)] : null,
    run.events && run.events.length ? [h("h3", {}, `events set (${run.events.length})`), eventTable(run.events)] : null,
    run.streams && run.streams.length ? [h("h3", {}, `streams (${run.streams.length})`), streamPanels(run)] : null,
    run.audit.length ? [h("h3", {}, "audit"), auditTable(run.audit)] : null,
  );
  if (quiet && !document.querySelector("article.run")) return;
  const oldView = graphView;
  // A form an operator is filling is never redrawn: the live one, with what
  // was typed or chosen in it, takes the place of the new page's.
  const focused = document.activeElement;
  const kept = quiet ? formsBeingFilled() : [];
  for (const form of kept) {
    const fresh = page.querySelector(`form#${form.id}`);
    if (fresh) fresh.replaceWith(form);
  }
  fill(main, page);
  if (focused && kept.some((form) => form.contains(focused))) focused.focus();
  drawGraph(graph, run, detail);
  if (quiet && oldView) setView(oldView);
  onSnapshot = (snapshot, changed) => { if (changed && !TERMINAL.includes(run.status)) refetchSoon(); };
}

// A run's streams, read live over Server-Sent Events: one EventSource per
// stream of the run shown, kept across the page's re-renders, closed when
// another run is shown. Text values are joined as they come (a model's
// tokens); other values are shown one JSON per line.
const streamViews = new Map();

function streamPanels(run) {
  for (const [id, view] of streamViews) {
    if (view.run !== run.id) { view.source.close(); streamViews.delete(id); }
  }
  return h("div", { class: "streams" }, run.streams.map((st) => {
    const id = `${run.id}/${st.key}`;
    let view = streamViews.get(id);
    if (!view) {
      const pre = h("pre", { class: "value stream", "data-stream": st.key, "data-state": "reading" });
      const source = new EventSource(`${BASE}/api/runs/${encodeURIComponent(run.id)}/streams/${encodeURIComponent(st.key)}`);
      view = { run: run.id, pre, source };
      source.onmessage = (event) => {
        const value = JSON.parse(event.data);
        pre.textContent += typeof value === "string" ? value : `${JSON.stringify(value)}\n`;
      };
      source.addEventListener("end", () => { source.close(); pre.dataset.state = "closed"; });
      streamViews.set(id, view);
    }
    return h("div", { class: "stream-panel" }, h("h4", { class: "mono" }, st.key), view.pre);
  }));
}
// A field changed from what the page drew, or the focus in the form.
const edited = (el) => (el.type === "radio" || el.type === "checkbox" ? el.checked !== el.defaultChecked
  : el.tagName === "SELECT" ? [...el.options].some((o) => o.selected !== o.defaultSelected)
  : "defaultValue" in el && el.value !== el.defaultValue);
const formsBeingFilled = () => [...main.querySelectorAll("form[id]")]
  .filter((form) => form.contains(document.activeElement) || [...form.elements].some(edited));

const LEGEND = { done: "done", failed: "failed", inflight: "in progress", waiting: "waiting (sleep, wait, back-off)",
  uncertain: "uncertain: unsafe, outcome unknown", unreached: "not reached" };

function rerunPanel(run) {
  const failed = [...run.steps].reverse().find((s) => s.status === "failed");
  const chosen = (failed || run.steps[run.steps.length - 1]).step_id;
  return h("section", { class: "panel", id: "rerun" },
    h("h3", {}, "re-run from a step"),
    h("p", { class: "muted" }, "A new run of the same workflow and args: the recorded outcomes of the steps before the one chosen are copied (replay serves them: no payment is repeated), it and what follows run again. This run keeps its steps. The CLI: ",
      h("code", {}, `everystep rerun ${run.id} --from-step ${chosen}`)),
    h("form", { id: "rerun-form", onsubmit: async (ev) => {
      ev.preventDefault();
      const step = ev.target.step.value;
      const answer = await confirmed(`Re-run ${run.id} from step ${step}? The steps before it are copied; it and what follows run again.`, "rerun", { runs: [run.id], from_step: step });
      if (answer && answer.done.length) location.hash = `run/${answer.done[0]}`;
    } },
      h("label", {}, "from step ", h("select", { name: "step", "aria-label": "from step" },
        run.steps.map((st) => h("option", { value: st.step_id, selected: st.step_id === chosen }, `${st.step_id} · ${st.name.split(".").pop()} · ${st.status}`)))),
      " ", h("button", {}, "Re-run from this step")));
}

function sendPanel(run) {
  const topic = run.waiting_on && run.waiting_on.startsWith("message:") ? run.waiting_on.slice(8) : "";
  return h("section", { class: "panel", id: "send" },
    h("h3", {}, "send a message"),
    h("form", { id: "send-form", onsubmit: async (ev) => {
      ev.preventDefault();
      const t = ev.target.topic.value.trim(), payload = ev.target.payload.value.trim() || "null";
      await confirmed(`Send a message on ${t} to run ${run.id}?`, "send", { run: run.id, topic: t, payload });
    } },
      h("input", { name: "topic", value: topic, placeholder: "topic", size: 16, "aria-label": "topic", required: true }), " ",
      h("input", { name: "payload", placeholder: "payload JSON, e.g. {\"approved\": true}", size: 40, "aria-label": "payload" }), " ",
      h("button", {}, "Send")),
    topic ? h("p", { class: "muted" }, `The run waits for a message on ${topic}.`) : null);
}

// The traceback of the failed step the run ended on (its last attempt), and
// where the worker's log lines are: in the log store, not in the database
// the console reads.
function runTraceback(run) {
  const failed = [...run.steps].reverse().find((s) => s.status === "failed");
  const kept = failed && tracebacksOf(run, failed.step_id);
  const last = kept && kept.length ? kept[kept.length - 1] : null;
  return [last ? h("details", { id: "run-traceback", open: true },
    h("summary", {}, `traceback of step ${failed.step_id}, attempt ${last.attempt}`), h("pre", { class: "traceback" }, last.traceback)) : null,
  h("p", { class: "muted", id: "run-logs" }, "The worker's log lines of this run are where its logs go (not in the database): search them for ",
    h("code", {}, `run=${run.id}`), " (with logging.format: json, ", h("code", {}, `"run": "${run.id}"`), ").")];
}

const tracebacksOf = (run, stepId) => (run.tracebacks || []).filter((t) => t.step_id === stepId);

function executionTable(run) {
  return h("table", { id: "executions", class: "executions" },
    h("thead", {}, h("tr", {}, ["token", "claimed by", "first step (UTC)", "last step (UTC)", "steps", "ended (UTC)", "how it ended"].map((t) => h("th", {}, t)))),
    h("tbody", {}, run.execution_history.map((e) => h("tr", { "data-outcome": e.outcome },
      h("td", { class: "mono" }, e.token), h("td", { class: "mono" }, e.claimer || "-"),
      h("td", {}, whenMs(e.first_step_at)), h("td", {}, whenMs(e.last_step_at)), h("td", {}, e.steps),
      h("td", {}, when(e.ended_at)), h("td", {}, badge(e.outcome), " ", e.how || "")))),
    run.execution_history.length ? null : h("caption", { class: "muted" }, "never claimed"));
}

function messageTable(messages) {
  return h("table", { id: "messages" }, h("thead", {}, h("tr", {}, ["#", "topic", "payload", "sent (UTC)", "taken by step", "taken (UTC)"].map((t) => h("th", {}, t)))),
    h("tbody", {}, messages.map((m) => h("tr", {}, h("td", {}, m.id), h("td", { class: "mono" }, m.topic),
      h("td", {}, h("pre", { class: "value inline" }, readable(m.payload))), h("td", {}, when(m.created_at)),
      h("td", { class: "mono" }, m.consumed_by || "not yet"), h("td", {}, when(m.consumed_at))))));
}

function eventTable(events) {
  return h("table", { id: "events" }, h("thead", {}, h("tr", {}, ["key", "value", "set (UTC)"].map((t) => h("th", {}, t)))),
    h("tbody", {}, events.map((e) => h("tr", {}, h("td", { class: "mono" }, e.key),
      h("td", {}, h("pre", { class: "value inline" }, readable(e.value))), h("td", {}, when(e.updated_at))))));
}

// Step attempts that ran past their @step(timeout=): retried ones and final failures.
function stepTimeouts(run) {
  const timedOut = (e) => e && e.type === "everystep.errors.StepTimeout";
  return run.steps.reduce((n, s) => n + (s.attempts || []).filter((a) => timedOut(a.error)).length
    + (s.status === "failed" && timedOut(s.error) ? 1 : 0), 0);
}

function resolvePanel(run) {
  const step = run.resolve.step;
  const box = h("section", { class: "resolve", id: "resolve" },
    h("h3", {}, `blocked on step ${step}`),
    h("p", {}, "The step is unsafe to repeat and was started without a recorded outcome. Find out whether its effect happened, then say so:"),
    h("ul", {},
      h("li", {}, h("b", {}, "it happened"), ": record its result (JSON) — ", h("code", {}, run.resolve.cli[0])),
      h("li", {}, h("b", {}, "it happened and failed"), ": record an error message — ", h("code", {}, run.resolve.cli[1])),
      h("li", {}, h("b", {}, "it did not happen"), ": discard the started mark; the step runs again — ", h("code", {}, run.resolve.cli[2]))));
  if (ROLE === "operator") {
    const form = h("form", { id: "resolve-form", onsubmit: async (ev) => {
      ev.preventDefault();
      const outcome = ev.target.outcome.value;
      const value = ev.target.value.value;
      const what = outcome === "discard" ? "discard its started mark (the step runs again)" : `record ${outcome} ${value}`;
      await confirmed(`Resolve step ${step} of run ${run.id}: ${what}?`, "resolve", { run: run.id, step, outcome, value });
    } },
      ["result", "error", "discard"].map((o) => h("label", {}, h("input", { type: "radio", name: "outcome", value: o, checked: o === "result" }), ` ${o} `)),
      h("input", { name: "value", placeholder: "result JSON, or error message", size: 40, "aria-label": "value" }),
      h("button", {}, "Resolve"));
    box.append(form);
  }
  return box;
}

// --- the step graph: ids are dotpaths; "3.1.2" is step 2 of branch 1 of fork 3.

function stepTree(steps) {
  const root = { items: new Map() };
  for (const s of steps) {
    const parts = s.step_id.split(".");
    let scope = root;
    for (let i = 0; i + 2 < parts.length; i += 2) {
      let fork = scope.items.get(parts[i]);
      if (!fork || fork.kind !== "fork") { fork = { kind: "fork", id: parts.slice(0, i + 1).join("."), branches: new Map() }; scope.items.set(parts[i], fork); }
      let branch = fork.branches.get(parts[i + 1]);
      if (!branch) { branch = { items: new Map() }; fork.branches.set(parts[i + 1], branch); }
      scope = branch;
    }
    scope.items.set(parts[parts.length - 1], { kind: "step", step: s });
  }
  return root;
}

function orderScope(scope, prefix) {
  // Positional ids in number order, the numbers never recorded shown as not
  // reached. A named step takes a number too, so with names in the scope the
  // order is that of first appearance and gaps are not inferred.
  const keys = [...scope.items.keys()];
  if (keys.some((k) => !/^\d+$/.test(k))) return [...scope.items.values()];
  const max = Math.max(0, ...keys.map(Number));
  const items = [];
  for (let n = 1; n <= max; n++) items.push(scope.items.get(String(n)) || { kind: "missing", id: prefix + n });
  return items;
}

const NODE_W = 150, NODE_H = 34, GAP_X = 40, GAP_Y = 14, FORK_W = 16;

function layoutScope(scope, prefix) {
  const items = orderScope(scope, prefix).map((it) => (it.kind === "fork" ? layoutFork(it) : { ...it, w: NODE_W, h: NODE_H }));
  return { kind: "seq", items, w: items.reduce((a, it) => a + it.w, 0) + GAP_X * Math.max(items.length - 1, 0), h: Math.max(NODE_H, ...items.map((it) => it.h)) };
}

function layoutFork(fork) {
  const branches = [...fork.branches.entries()].sort((a, b) => Number(a[0]) - Number(b[0]))
    .map(([index, scope]) => ({ index, ...layoutScope(scope, `${fork.id}.${index}.`) }));
  const inner = Math.max(NODE_W, ...branches.map((b) => b.w));
  return { ...fork, branches, w: FORK_W + GAP_X + inner + GAP_X + FORK_W,
    h: branches.reduce((a, b) => a + b.h, 0) + GAP_Y * Math.max(branches.length - 1, 0) };
}

const ENGINE = "everystep.";  // the engine's own rows: sleeps, waits, child starts, events

// What a node shows: orange "uncertain" only for an unsafe step started
// without a recorded outcome; a wait not ended yet, a sleep, a retry's
// back-off the run is parked on, are "waiting".
function nodeState(item, run) {
  if (item.kind === "missing") return "unreached";
  if (item.kind === "current") return "inflight";
  const s = item.step.status;
  if (s === "started") {
    if (item.step.name.startsWith(ENGINE)) return "waiting";
    return run.status === "running" ? "inflight" : "uncertain";
  }
  if (s === "retrying") return run.status === "running" ? "inflight" : "waiting";
  if (run.status === "waiting" && run.parkedOn === item.step.step_id) return "waiting";
  return s;  // done, failed
}

// The step a waiting run is parked on: its newest sleep, wait or child wait.
function parkedOn(run) {
  if (run.status !== "waiting") return null;
  const rows = run.steps.filter((st) => st.name.startsWith(ENGINE) || st.status === "retrying");
  return rows.length ? rows.reduce((a, b) => (b.id > a.id ? b : a)).step_id : null;
}

// A running run shows where it is: the step being executed has no row yet
// (a step's row is written when it ends), so it is drawn after the last
// recorded top-level step, unless an in-flight row says where it is.
function addCurrent(tree, run) {
  if (run.status !== "running" || run.steps.some((st) => st.status === "started" || st.status === "retrying")) return;
  const keys = [...tree.items.keys()];
  const next = keys.every((k) => /^\d+$/.test(k)) ? String(Math.max(0, ...keys.map(Number)) + 1) : `next`;
  tree.items.set(next, { kind: "current", id: next });
}

let graphView = null;
let graphSvg = null;
const SVGNS = "http://www.w3.org/2000/svg";
const svg = (tag, attrs) => { const el = document.createElementNS(SVGNS, tag); for (const [k, v] of Object.entries(attrs)) el.setAttribute(k, v); return el; };

function drawGraph(container, run, detail) {
  run.parkedOn = parkedOn(run);
  const scope = stepTree(run.steps);
  addCurrent(scope, run);
  const tree = layoutScope(scope, "");
  const width = tree.w + 2 * NODE_H + 40, height = tree.h + 40;
  const root = svg("svg", { width: "100%", height: Math.min(Math.max(height, 120), 520), role: "img", "aria-label": "step graph" });
  const g = svg("g", {});
  root.append(g);
  const start = svg("circle", { cx: 20, cy: 20 + tree.h / 2, r: 8, class: "terminal" });
  g.append(start);
  const out = placeSeq(g, tree, 40 + GAP_X / 2, 20, [[28, 20 + tree.h / 2]], run, detail);
  const endX = 40 + GAP_X / 2 + tree.w + GAP_X;
  for (const [x, y] of out) g.append(svg("line", { x1: x, y1: y, x2: endX - 8, y2: 20 + tree.h / 2, class: "edge" }));
  g.append(svg("circle", { cx: endX, cy: 20 + tree.h / 2, r: 8, class: `terminal end ${run.status}` }));
  container.replaceChildren(root);
  graphSvg = root;
  graphView = { x: 0, y: 0, w: endX + 20, h: height };
  setView(graphView);
  let drag = null;
  root.addEventListener("pointerdown", (ev) => { drag = { x: ev.clientX, y: ev.clientY, v: { ...graphView } }; });
  root.addEventListener("pointermove", (ev) => {
    if (!drag) return;
    const scale = graphView.w / root.clientWidth;
    setView({ ...drag.v, x: drag.v.x - (ev.clientX - drag.x) * scale, y: drag.v.y - (ev.clientY - drag.y) * scale });
  });
  root.addEventListener("pointerup", () => { drag = null; });
  root.addEventListener("wheel", (ev) => { ev.preventDefault(); zoom(ev.deltaY < 0 ? 1.1 : 0.9); }, { passive: false });
}

function setView(v) { graphView = v; if (graphSvg) graphSvg.setAttribute("viewBox", `${v.x} ${v.y} ${v.w} ${v.h}`); }
function zoom(f) { if (graphView) setView({ x: graphView.x + (graphView.w * (1 - 1 / f)) / 2, y: graphView.y + (graphView.h * (1 - 1 / f)) / 2, w: graphView.w / f, h: graphView.h / f }); }
function fit() { if (graphSvg) { const b = graphSvg.querySelector("g").getBBox(); setView({ x: b.x - 10, y: b.y - 10, w: b.width + 20, h: b.height + 20 }); } }

// Places a sequence at (x, y); `from` are the points its first item is entered from; returns its exit points.
function placeSeq(g, seq, x, y, from, run, detail) {
  let points = from;
  for (const it of seq.items) {
    const top = y + (seq.h - it.h) / 2;
    if (it.kind === "fork") points = placeFork(g, it, x, top, points, run, detail);
    else {
      const cy = top + NODE_H / 2;
      for (const [px, py] of points) g.append(svg("line", { x1: px, y1: py, x2: x, y2: cy, class: "edge" }));
      const state = nodeState(it, run);
      const id = it.kind === "step" ? it.step.step_id : it.id;
      const node = svg("g", { class: `node ${state}`, "data-step": id, "data-state": state, tabindex: 0 });
      node.append(svg("rect", { x, y: top, width: NODE_W, height: NODE_H, rx: 6 }));
      const label = svg("text", { x: x + 8, y: top + 14 });
      label.textContent = id;
      const sub = svg("text", { x: x + 8, y: top + 28, class: "sub" });
      sub.textContent = it.kind === "missing" ? "not reached" : it.kind === "current" ? "in progress…"
        : it.step.name.split(".").pop() + ` · ${copiedStep(run, it.step) ? "copied" : LEGEND[state] ? LEGEND[state].split(" ")[0] : state}`;
      const title = svg("title", {});
      title.textContent = it.kind === "missing" ? `${id}: not reached` : it.kind === "current" ? `${id}: being executed now (its row is written when it ends)` : `${id} ${it.step.name}: ${LEGEND[state] || state}`;
      node.append(title, label, sub);
      if (it.kind === "step") {
        if (copiedStep(run, it.step)) node.dataset.copied = "";
        node.addEventListener("click", () => showStep(detail, it.step, state, tracebacksOf(run, it.step.step_id),
          copiedStep(run, it.step) ? run.rerun_of : null));
      }
      g.append(node);
      points = [[x + NODE_W, cy]];
    }
    x += it.w + GAP_X;
  }
  return points;
}

function placeFork(g, fork, x, y, from, run, detail) {
  const cy = y + fork.h / 2;
  for (const [px, py] of from) g.append(svg("line", { x1: px, y1: py, x2: x, y2: cy, class: "edge" }));
  const diamond = (cx) => svg("polygon", { points: `${cx - 8},${cy} ${cx},${cy - 8} ${cx + 8},${cy} ${cx},${cy + 8}`, class: "fork" });
  const split = diamond(x + FORK_W / 2);
  const tip = svg("title", {});
  tip.textContent = `parallel ${fork.id}`;
  split.append(tip);
  g.append(split);
  let top = y;
  const ends = [];
  const innerX = x + FORK_W + GAP_X;
  for (const b of fork.branches) {
    ends.push(...placeSeq(g, b, innerX, top, [[x + FORK_W, cy]], run, detail));
    top += b.h + GAP_Y;
  }
  const joinX = x + fork.w - FORK_W;
  const innerEnd = joinX - GAP_X / 2;  // a shorter branch runs straight on to here, then joins
  for (const [px, py] of ends) {
    if (px < innerEnd) g.append(svg("line", { x1: px, y1: py, x2: innerEnd, y2: py, class: "edge" }));
    g.append(svg("line", { x1: Math.max(px, innerEnd), y1: py, x2: joinX, y2: cy, class: "edge" }));
  }
  g.append(diamond(joinX + FORK_W / 2));
  return [[x + fork.w, cy]];
}

function showStep(detail, step, state, tracebacks = [], copiedFrom = null) {
  fill(detail, 
    h("h4", {}, h("span", { class: "mono" }, step.step_id), " ", badge(state)),
    h("p", { class: "mono" }, step.name),
    copiedFrom ? h("p", { class: "copied-from" }, "copied from run ", runLink(copiedFrom, short(copiedFrom)), ": its outcome, served by replay, not run again here") : null,
    step.started_at ? h("p", {}, `${copiedFrom ? "it ran: " : ""}started ${whenMs(step.started_at)}, finished ${whenMs(step.finished_at)}`) : null,
    h("h5", {}, "args"), h("pre", { class: "value" }, readable(step.args)),
    step.kwargs && Object.keys(step.kwargs).length ? [h("h5", {}, "kwargs"), h("pre", { class: "value" }, readable(step.kwargs))] : null,
    // The engine's rows keep times as epoch seconds: shown as dates.
    step.name === "everystep.sleep" && typeof step.result === "number" ? h("p", { id: "step-wake" }, `sleeps until ${epochWhen(step.result)}`) : null,
    step.result && typeof step.result === "object" && typeof step.result.deadline === "number"
      ? h("p", { id: "step-deadline" }, `waits${step.result.topic ? ` for a message on ${step.result.topic}` : ""} until ${epochWhen(step.result.deadline)} at the latest`) : null,
    (step.attempts || []).map((a) => h("p", { class: "attempt error" }, `attempt ${a.attempt} failed at ${epochWhen(a.at)} (${describeError(a.error)}); retried at ${epochWhen(a.retry_at)}`)),
    step.status === "done" ? [h("h5", {}, "result"), h("pre", { class: "value", id: "step-result" }, readable(step.result))] : null,
    step.error ? [h("h5", {}, "error"), h("pre", { class: "value error" }, describeError(step.error))] : null,
    tracebacks.map((t) => h("details", { class: "step-traceback", "data-attempt": t.attempt, open: t === tracebacks[tracebacks.length - 1] },
      h("summary", {}, `traceback of attempt ${t.attempt}`), h("pre", { class: "traceback" }, t.traceback))),
    step.status === "started" ? h("p", {}, "started; outcome not recorded") : null);
}

// Each attempt of a retried step is its own bar (its error and back-off in
// its title), the back-off drawn as a gap; the last attempt runs from the
// row's started_at to its finished_at.
// A re-run's steps before its from-step are copies of the old run's
// outcomes (no execution of this run wrote them): drawn as copied, their
// old times left out of this run's span.
const copiedStep = (run, st) => Boolean(run.rerun_of) && !st.claim_token;

function timeline(run) {
  const bars = [];
  const copied = run.steps.filter((st) => copiedStep(run, st));
  for (const st of run.steps) {
    if (copiedStep(run, st)) continue;
    const attempts = st.attempts || [];
    attempts.forEach((a, i) => {
      const begin = i ? attempts[i - 1].retry_at * 1000 : a.at * 1000;
      bars.push({ step: st, kind: "attempt", a: begin, b: a.at * 1000, n: a.attempt,
        title: `${st.step_id} attempt ${a.attempt} failed at ${epochWhen(a.at)}: ${describeError(a.error)}; back-off until ${epochWhen(a.retry_at)}` });
      bars.push({ step: st, kind: "backoff", a: a.at * 1000, b: a.retry_at * 1000, n: a.attempt,
        title: `${st.step_id} back-off after attempt ${a.attempt}: ${((a.retry_at - a.at)).toFixed(2)} s, until ${epochWhen(a.retry_at)}` });
    });
    if (st.started_at) {
      const a = Date.parse(st.started_at), b = st.finished_at ? Date.parse(st.finished_at) : a;
      const kind = st.status === "started" && st.name.startsWith(ENGINE) ? "waiting" : st.status;  // a wait, not an unknown outcome
      if (!attempts.length || st.status !== "retrying") bars.push({ step: st, kind, a, b, n: attempts.length + 1, open: !st.finished_at,
        title: `${st.step_id}${attempts.length ? ` attempt ${attempts.length + 1}` : ""}: ${b - a} ms` });
    }
  }
  const copiedLanes = copied.map((st) => h("div", { class: "lane copied", "data-step": st.step_id, "data-copied": "" },
    h("span", { class: "mono label" }, st.step_id),
    h("span", { class: "track" }, h("span", { class: "copied-note", title: `recorded by run ${run.rerun_of}; served from the record, not run again` },
      "copied from ", runLink(run.rerun_of, short(run.rerun_of)))),
    h("span", { class: "ms" }, "copied")));
  if (!bars.length) return h("div", { class: "timeline", id: "timeline" }, copiedLanes, h("p", { class: "muted" }, "no step of this run's own timed yet"));
  const t0 = Math.min(...bars.map((x) => x.a));
  const t1 = Math.max(...bars.map((x) => x.b), t0 + 1);
  const span = t1 - t0;
  const lanes = [...new Set(bars.map((x) => x.step.step_id))];
  return h("div", { class: "timeline", id: "timeline" }, copiedLanes, lanes.map((id) => {
    const mine = bars.filter((x) => x.step.step_id === id);
    const last = mine[mine.length - 1];
    const tries = mine.filter((x) => x.kind !== "backoff").length;
    return h("div", { class: "lane", "data-step": id },
      h("span", { class: "mono label" }, id),
      h("span", { class: "track" }, mine.map((x) => h("span", { class: `bar ${x.kind}`, title: x.title, "data-attempt": x.kind === "attempt" ? x.n : null,
        style: `left:${(100 * (x.a - t0)) / span}%;width:${Math.max((100 * (x.b - x.a)) / span, 0.5)}%` }))),
      h("span", { class: "ms" }, last.open ? "…" : tries > 1 ? `${tries} attempts` : (last.b - last.a >= 1 ? `${last.b - last.a} ms` : "<1 ms")));
  }), h("p", { class: "muted" }, `${span} ms from the first step's start to the last step's end${copied.length ? ` (${copied.length} copied step(s) left out)` : ""}; hover a bar for its times, errors and back-offs`));
}

// ------------------------------------------------------------------ charts over time
// Inline SVG, no library: the per-minute figures the maintenance child keeps
// (everystep_minute), one workflow's or all, over the last hour or day.

const ENDED = ["completed", "failed", "cancelled", "stopped"];
const CW = 720, CH = 150, PAD_L = 44, PAD_B = 20, PAD_T = 8;

function minuteSeries(answer) {
  const minutes = answer.window === "day" ? 24 * 60 : 60;
  const end = Math.floor(Date.parse(answer.now) / 60000) * 60000;
  const rows = new Map(answer.minutes.map((m) => [Date.parse(m.minute), m]));
  const out = [];
  for (let t = end - (minutes - 1) * 60000; t <= end; t += 60000) out.push({ t, ...(rows.get(t) || {}) });
  // Minutes without a sample (the child was not running) carry no gauge value.
  return out;
}

// A day of minutes is 1,440 bars of a pixel: it is drawn in buckets of 15
// minutes (96 bars), an hour minute by minute. A bucket sums the runs ended
// in it; its backlog and latency are the most sampled in it, its blocked
// count the last.
const BUCKET_MINUTES = { hour: 1, day: 15 };

function buckets(points, size) {
  if (size <= 1) return points.map((p) => ({ ...p, minutes: 1 }));
  const groups = [];
  for (let end = points.length; end > 0; end -= size) groups.unshift(points.slice(Math.max(end - size, 0), end));
  return groups.map((group) => {  // the newest bucket ends at the newest minute
    const b = { t: group[0].t, minutes: group.length };
    for (const k of ENDED) b[k] = group.reduce((a, p) => a + (p[k] || 0), 0);
    for (const k of ["due", "oldest_due_s"]) {
      const seen = group.map((p) => p[k]).filter((v) => v !== undefined && v !== null);
      if (seen.length) b[k] = Math.max(...seen);
    }
    const blocked = group.map((p) => p.blocked).filter((v) => v !== undefined && v !== null);
    if (blocked.length) b.blocked = blocked[blocked.length - 1];
    return b;
  });
}
const bucketSpan = (p) => (p.minutes > 1 ? `${hhmm(p.t)}–${hhmm(p.t + p.minutes * 60000)}` : hhmm(p.t));

const hhmm = (t) => new Date(t).toISOString().slice(11, 16);
const niceMax = (v) => { if (v <= 0) return 1; const p = 10 ** Math.floor(Math.log10(v)); return Math.ceil(v / p) * p; };

function chartFrame(id, title, max, points, unit) {
  // Scaled only as a whole (never stretched): its text keeps its shape.
  const root = svg("svg", { viewBox: `0 0 ${CW} ${CH}`, width: CW, height: CH, class: "chart", id, role: "img", "aria-label": title });
  const plotH = CH - PAD_B - PAD_T;
  for (const f of [0, 0.5, 1]) {
    const y = PAD_T + plotH * (1 - f);
    root.append(svg("line", { x1: PAD_L, x2: CW, y1: y, y2: y, class: "grid" }));
    const label = svg("text", { x: PAD_L - 4, y: y + 4, class: "axis", "text-anchor": "end" });
    label.textContent = `${+(max * f).toFixed(max * f < 10 ? 1 : 0)}${unit || ""}`;
    root.append(label);
  }
  const n = points.length;
  // Each point has a slot of its own (a bar drawn whole, the first and last
  // too); the last label is the newest minute, the end of the last bucket.
  const x = (i) => PAD_L + ((CW - PAD_L) * (i + 0.5)) / Math.max(n, 1);
  for (const i of [0, Math.floor(n / 2), n - 1]) {
    const label = svg("text", { x: i === 0 ? PAD_L : i === n - 1 ? CW - 2 : x(i), y: CH - 4, class: "axis", "text-anchor": i === 0 ? "start" : i === n - 1 ? "end" : "middle" });
    const t = i === n - 1 ? points[i].t + ((points[i].minutes || 1) - 1) * 60000 : points[i].t;
    label.textContent = `${hhmm(t)}${i === n - 1 ? " UTC" : ""}`;
    root.append(label);
  }
  return { root, plotH, x, y: (v) => PAD_T + plotH * (1 - v / max), barW: (CW - PAD_L) / Math.max(n, 1) };
}

function endedChart(points) {
  const max = niceMax(Math.max(...points.map((p) => ENDED.reduce((a, k) => a + (p[k] || 0), 0)), ...points.map((p) => p.blocked || 0)));
  const f = chartFrame("chart-ended", "runs ended by status", max, points);
  points.forEach((p, i) => {
    let base = 0;
    for (const k of ENDED) {
      const v = p[k] || 0;
      if (!v) continue;
      const rect = svg("rect", { x: f.x(i) - f.barW / 2, width: Math.max(f.barW - 0.5, 0.6), y: f.y(base + v), height: f.y(base) - f.y(base + v), class: `s-${k}`, "data-status": k });
      const tip = svg("title", {});
      tip.textContent = `${bucketSpan(p)} UTC: ${v} ${k}`;
      rect.append(tip);
      f.root.append(rect);
      base += v;
    }
  });
  f.root.append(polyline(points, f, "blocked", "s-blocked"));
  return f.root;
}

function polyline(points, f, key, cls) {
  const pts = points.map((p, i) => (p[key] === undefined || p[key] === null ? null : `${f.x(i)},${f.y(p[key])}`)).filter(Boolean);
  return svg("polyline", { points: pts.join(" "), class: `line ${cls}`, fill: "none" });
}

function gaugeChart(points, key, id, title, unit) {
  const max = niceMax(Math.max(0, ...points.map((p) => p[key] || 0)));
  const f = chartFrame(id, title, max, points, unit);
  f.root.append(polyline(points, f, key, `s-${key}`));
  const lastAt = points.map((p) => p[key]).filter((v) => v !== undefined && v !== null);
  f.root.dataset.last = lastAt.length ? lastAt[lastAt.length - 1] : "";
  return f.root;
}

const seconds = (v) => (v === null || v === undefined ? "-" : v < 1 ? `${(v * 1000).toFixed(1)} ms` : `${v.toFixed(2)} s`);

function stepTable(steps, runs) {
  if (!steps.length) return h("p", { class: "muted" }, "no timed steps among the newest runs");
  const top = Math.max(...steps.map((st) => st.p99 || 0), 1e-9);
  return h("table", { id: "step-durations" }, h("thead", {}, h("tr", {}, ["step", "steps", "failed", "p50", "p90", "p99", "max", ""].map((t) => h("th", {}, t)))),
    h("tbody", {}, steps.map((st) => h("tr", { "data-step-name": st.name }, h("td", { class: "mono" }, st.name), h("td", {}, st.steps), h("td", {}, st.failed),
      h("td", {}, seconds(st.p50)), h("td", {}, seconds(st.p90)), h("td", {}, seconds(st.p99)), h("td", {}, seconds(st.max)),
      h("td", { class: "dist" }, h("span", { class: "p99", style: `width:${(100 * st.p99) / top}%` }, h("span", { class: "p50", style: `width:${st.p99 ? (100 * st.p50) / st.p99 : 0}%` })))))),
    h("caption", { class: "muted" }, `over the steps of the newest ${runs} runs`));
}

async function showCharts(quiet) {
  const p = new URLSearchParams({ window: current.window || "hour" });
  if (current.workflow) p.set("workflow", current.workflow);
  const asked = current;
  const [answer, names] = await Promise.all([getJSON(`/api/charts?${p}`), quiet ? Promise.resolve(null) : getJSON("/api/workflows").catch(() => ({ workflows: [] }))]);
  if (current !== asked) return;
  const size = BUCKET_MINUTES[answer.window] || 1;
  const points = buckets(minuteSeries(answer), size);
  const per = size > 1 ? `${size} minutes` : "minute";
  const legend = h("p", { class: "legend" }, ENDED.map((k) => h("span", { class: `key s-${k}` }, k)), h("span", { class: "key s-blocked" }, `blocked (at the ${per === "minute" ? "minute" : "bucket"}'s end)`));
  const body = [
    h("h3", { id: "ended-title" }, `runs ended per ${per}`), legend, endedChart(points),
    h("h3", {}, "backlog: runs due, not claimed"), gaugeChart(points, "due", "chart-due", "runs due and not claimed", ""),
    h("h3", {}, "pickup latency: how long the oldest due run has waited"), gaugeChart(points, "oldest_due_s", "chart-latency", "pickup latency", " s"),
    h("h3", {}, "step durations"), stepTable(answer.steps, answer.step_runs),
    h("p", { class: "muted" }, `Per-minute figures kept by the maintenance child every 10 s (a run counts in the minute it ended if it ended within ${answer.lookback_s / 3600} h of being scheduled); the backlog and the latency are sampled. Times in UTC.`),
  ];
  if (quiet && document.getElementById("charts")) {
    fill(document.getElementById("chart-body"), body);
    return;
  }
  const choose = (changes) => go(`charts?${new URLSearchParams({ ...(current.workflow ? { workflow: current.workflow } : {}), window: current.window || "hour", ...changes })}`);
  fill(main, h("section", { id: "charts" }, h("h2", {}, "Charts"),
    h("p", { class: "filters" },
      h("select", { name: "workflow", "aria-label": "workflow", onchange: (ev) => choose({ workflow: ev.target.value }) },
        h("option", { value: "" }, "every workflow"), (names ? names.workflows : []).map((n) => h("option", { value: n, selected: current.workflow === n }, n))),
      ["hour", "day"].map((w) => h("button", { class: w === (current.window || "hour") ? "active" : "", "data-window": w, onclick: () => choose({ window: w }) }, `last ${w}`))),
    h("div", { id: "chart-body" }, body)));
  onSnapshot = (snapshot, changed) => { if (changed) refetchSoon(); };
}

const FIRE_COLORS = { completed: "completed", failed: "failed", cancelled: "cancelled", stopped: "stopped", running: "running" };

async function showFires() {
  const asked = current;
  const { key, fires } = await getJSON(`/api/schedules/${encodeURIComponent(current.key)}/fires`);
  if (current !== asked) return;
  const strip = h("div", { class: "fires", id: "fire-strip" }, [...fires].reverse().map((f) => h("a", { href: `#run/${f.run_id}`,
    class: `fire status ${FIRE_COLORS[f.status] || f.status || "pruned"}`, "data-status": f.status || "pruned",
    title: `${when(f.fire_at)}: ${f.status || "pruned"}` })));
  const counts = {};
  for (const f of fires) counts[f.status || "pruned"] = (counts[f.status || "pruned"] || 0) + 1;
  fill(main, h("h2", {}, "schedule ", h("span", { class: "mono" }, key)),
    h("p", {}, h("a", { href: "#schedules" }, "← schedules")),
    fires.length ? [h("h3", {}, `its newest ${fires.length} fires, oldest first`), strip,
      h("p", {}, Object.entries(counts).map(([k, n]) => [badge(k), ` ${n} `])),
      h("table", { id: "fires" }, h("thead", {}, h("tr", {}, ["fire time (UTC)", "fired (UTC)", "run", "outcome", "ended (UTC)"].map((t) => h("th", {}, t)))),
        h("tbody", {}, fires.map((f) => h("tr", {}, h("td", {}, when(f.fire_at)), h("td", {}, when(f.fired_at)),
          h("td", {}, runLink(f.run_id, short(f.run_id))), h("td", {}, badge(f.status || "pruned")), h("td", {}, when(f.completed_at))))))]
      : h("p", { class: "muted" }, "it has not fired yet"));
  onSnapshot = (snapshot, changed) => { if (changed) refetchSoon(); };
}

// ------------------------------------------------------------------ other pages

// Graphs of runs (everystep.dags): the list, filtered by status, and one
// graph drawn in columns by depth (a member right of every dependency).
const DAG_STATUSES = ["open", "running", "completed", "failed", "cancelled"];
const DAG_DRAWN = 2000;  // members drawn at most; the table lists them all

async function showDags() {
  const asked = current;
  const status = current.status;
  const { dags } = await getJSON(`/api/dags${status ? `?status=${status}` : ""}`);
  if (current !== asked) return;
  const filter = (s) => h("a", { href: s ? `#dags?status=${s}` : "#dags", class: `filter${s === status ? " active" : ""}`, "data-status": s || "all" }, s || "all");
  fill(main, h("h2", {}, "Graphs"),
    h("p", { id: "dag-filters" }, [filter(""), ...DAG_STATUSES.map(filter)].map((a) => [a, " "])),
    dags.length ? h("table", { id: "dags" },
      h("thead", {}, h("tr", {}, ["key", "status", "members", "completed", "created", "sealed"].map((t) => h("th", {}, t)))),
      h("tbody", {}, dags.map((d) => h("tr", { "data-key": d.key },
        h("td", { class: "mono" }, h("a", { href: `#dag/${encodeURIComponent(d.key)}` }, d.key)), h("td", {}, badge(d.status)),
        h("td", {}, d.members), h("td", {}, d.completed), h("td", {}, when(d.created_at)), h("td", {}, when(d.sealed_at))))))
      : h("p", { class: "muted" }, status ? `no ${status} graphs` : "no graphs"));
  onSnapshot = (snapshot, changed) => { if (changed) refetchSoon(); };
}

async function showDag(quiet) {
  const asked = current;
  const dag = await getJSON(`/api/dags/${encodeURIComponent(current.key)}`);
  if (current !== asked) return;
  const graph = h("div", { class: "graph dag-graph", id: "dag-graph" });
  fill(main, h("h2", {}, "graph ", h("span", { class: "mono" }, dag.key), " ", badge(dag.status)),
    h("p", {}, h("a", { href: "#dags" }, "← graphs"), ` · ${dag.members.length} members · sealed ${when(dag.sealed_at)}`),
    graph,
    h("table", { id: "dag-members" }, h("thead", {}, h("tr", {}, ["member", "status", "depends on", "run", "cancel reason"].map((t) => h("th", {}, t)))),
      h("tbody", {}, dag.members.map((m) => h("tr", { "data-member": m.key }, h("td", { class: "mono" }, m.key), h("td", {}, badge(m.status || "pruned")),
        h("td", { class: "mono" }, m.depends_on.join(", ") || "-"), h("td", {}, runLink(m.run_id, short(m.run_id))), h("td", {}, m.cancel_reason || ""))))));
  drawDag(graph, dag.members.slice(0, DAG_DRAWN));
  onSnapshot = (snapshot, changed) => { if (changed && !["completed", "failed", "cancelled"].includes(dag.status)) refetchSoon(); };
}

function drawDag(container, members) {
  const NS = "http://www.w3.org/2000/svg";
  const el = (tag, attrs, ...kids) => { const e = document.createElementNS(NS, tag); for (const [k, v] of Object.entries(attrs)) e.setAttribute(k, v); kids.forEach((k) => e.append(k)); return e; };
  const depth = {}, rows = [], at = {};
  for (const m of members) {  // added after its dependencies: their depths are known
    depth[m.key] = Math.max(-1, ...m.depends_on.map((d) => (d in depth ? depth[d] : -1))) + 1;
    const column = (rows[depth[m.key]] = rows[depth[m.key]] || []);
    at[m.key] = { x: 20 + depth[m.key] * 190, y: 20 + column.length * 44 };
    column.push(m.key);
  }
  const width = 40 + rows.length * 190, height = 40 + Math.max(1, ...rows.map((r) => r.length)) * 44;
  const svg = el("svg", { viewBox: `0 0 ${width} ${height}`, width: Math.min(width, 1200), height: Math.min(height, 640) });
  const edges = el("g", { class: "edges" }), nodes = el("g", { class: "nodes" });
  for (const m of members) for (const d of m.depends_on) if (at[d]) {
    edges.append(el("line", { x1: at[d].x + 150, y1: at[d].y + 15, x2: at[m.key].x, y2: at[m.key].y + 15, class: "edge", "data-from": d, "data-to": m.key }));
  }
  for (const m of members) {
    const link = el("a", { href: `#run/${m.run_id}`, class: `dag-node status ${m.status || "pruned"}`, "data-member": m.key, "data-status": m.status || "pruned" },
      el("rect", { x: at[m.key].x, y: at[m.key].y, width: 150, height: 30, rx: 4 }),
      el("text", { x: at[m.key].x + 8, y: at[m.key].y + 19 }, `${m.key} · ${m.status || "pruned"}`));
    link.append(el("title", {}, `${m.key}: ${m.status || "pruned"} (run ${m.run_id})`));
    nodes.append(link);
  }
  svg.append(edges, nodes);
  container.append(svg);
}

async function showSchedules() {
  const asked = current;
  const { schedules } = await getJSON("/api/schedules");
  if (current !== asked) return;
  const verb = (s, v, q) => h("button", { onclick: () => confirmed(q, "schedule", { key: s.key, verb: v }) }, v);
  fill(main, h("h2", {}, "Schedules"), schedules.length ? h("table", { id: "schedules" },
    h("thead", {}, h("tr", {}, ["key", "workflow", "cron", "state", "next fire", "last fire", "last run", "last error", ""].map((t) => h("th", {}, t)))),
    h("tbody", {}, schedules.map((s) => {
      const state = s.retired_at ? "retired" : s.paused ? "paused" : "active";
      return h("tr", { "data-key": s.key },
        h("td", { class: "mono" }, h("a", { href: `#schedule/${encodeURIComponent(s.key)}`, title: "its fires and their outcomes" }, s.key)), h("td", { class: "mono" }, s.workflow), h("td", { class: "mono" }, `${s.cron} (${s.timezone})`),
        h("td", {}, badge(state)), h("td", {}, state === "active" ? when(s.next_fire_at) : "-"), h("td", {}, when(s.last_fire_at)),
        h("td", {}, s.last_run_id ? [runLink(s.last_run_id, s.last_run_id.slice(0, 8) + "…"), " ", badge(s.last_run_status || "pruned")] : "-"),
        h("td", { class: "error" }, s.last_error || ""),
        h("td", {}, ROLE === "operator" && state !== "retired" ? [
          state === "active" ? verb(s, "pause", `Pause schedule ${s.key}?`) : verb(s, "resume", `Resume schedule ${s.key}?`),
          verb(s, "fire", `Fire schedule ${s.key} now (a run outside its cron times)?`)] : ""));
    }))) : h("p", { class: "muted" }, "no schedules"));
}

async function showWorkers() {
  const asked = current;
  const { workers } = await getJSON("/api/workers");
  if (current !== asked) return;
  fill(main, h("h2", {}, "Workers"),
    h("p", { class: "muted" }, "Every runner holding its lock in this database now: its pool connections, its runs in flight, and since when its control session (which holds the lock) exists."),
    workers.length ? h("table", { id: "workers" }, h("thead", {}, h("tr", {}, ["runner", "client", "pool connections", "in flight", "lock held since"].map((t) => h("th", {}, t)))),
      h("tbody", {}, workers.map((w) => h("tr", {}, h("td", { class: "mono" }, w.name), h("td", {}, w.client || "local socket"),
        h("td", {}, w.pool_connections), h("td", {}, w.in_flight), h("td", {}, when(w.since))))))
      : h("p", { class: "muted" }, "no live runner"));
  onSnapshot = (snapshot, changed) => { if (changed) refetchSoon(); };
}

let failureWindow = "hour";
async function showFailures() {
  const asked = current;
  const { groups } = await getJSON(`/api/failures?window=${failureWindow}`);
  if (current !== asked) return;
  fill(main, h("h2", {}, "Failures"),
    h("p", {}, ["hour", "day", "week"].map((w) => h("button", { class: w === failureWindow ? "active" : "", onclick: () => { failureWindow = w; refresh(); } }, `last ${w}`))),
    groups.length ? h("table", { id: "failures" }, h("thead", {}, h("tr", {}, ["workflow", "exception", "runs", "last", "latest run", "latest message"].map((t) => h("th", {}, t)))),
      h("tbody", {}, groups.map((g) => h("tr", {},
        h("td", { class: "mono" }, h("a", { href: "#", onclick: (ev) => { ev.preventDefault(); Object.assign(filters, { status: "failed", workflow: g.workflow, q: "", since: "", until: "" }); go(filterHash()); } }, g.workflow)),
        h("td", { class: "mono" }, g.error_type), h("td", {}, g.runs), h("td", {}, when(g.last_at)),
        h("td", {}, runLink(g.latest_run, g.latest_run.slice(0, 8) + "…")), h("td", {}, g.latest_message || "")))))
      : h("p", { class: "muted" }, `no failed runs created in the last ${failureWindow}`));
}

function auditTable(records, filters = false) {
  // On the audit page, a person's or an action's cell filters by it.
  const by = (key, value) => filters ? h("a", { href: "#audit", class: `filter-${key}`, title: `only ${value}`, onclick: (ev) => {
    ev.preventDefault(); auditFilters[key] = value; refresh(); } }, value) : value;
  return h("table", { class: "audit" }, h("thead", {}, h("tr", {}, ["when", "who", "from", "action", "run", "step", "target", "values"].map((t) => h("th", {}, t)))),
    h("tbody", {}, records.map((r) => h("tr", {}, h("td", {}, when(r.at)), h("td", { class: "actor" }, by("actor", r.actor)), h("td", {}, r.source), h("td", { class: "action" }, by("action", r.action)),
      h("td", {}, r.run_id ? runLink(r.run_id, r.run_id.slice(0, 8) + "…") : "-"), h("td", { class: "mono" }, r.step_id || "-"),
      h("td", { class: "mono" }, r.target || "-"), h("td", { class: "mono" }, JSON.stringify(r.details))))));
}

// The audit page's filters: by person, action and run (each exact; empty: any).
const auditFilters = { actor: "", action: "", run: "" };
const AUDIT_ACTIONS = ["resolve-step", "requeue", "schedule-again", "cancel", "schedule", "prune", "schedules-apply",
  "schedules-retire", "schedule-pause", "schedule-resume", "schedule-fire", "environment"];

async function showAudit() {
  const query = new URLSearchParams({ limit: "200" });
  for (const [k, v] of Object.entries(auditFilters)) if (v) query.set(k, v);
  const form = h("form", { id: "audit-filters", class: "filters", onsubmit: (ev) => {
    ev.preventDefault();
    for (const k of Object.keys(auditFilters)) auditFilters[k] = ev.target[k].value.trim();
    refresh();
  } },
  h("label", {}, "who ", h("input", { name: "actor", value: auditFilters.actor, placeholder: "a person", size: 16 })),
  h("label", {}, " action ", h("select", { name: "action" }, h("option", { value: "" }, "any"),
    AUDIT_ACTIONS.map((a) => h("option", { value: a, selected: a === auditFilters.action }, a)))),
  h("label", {}, " run ", h("input", { name: "run", value: auditFilters.run, placeholder: "run id", size: 38 })),
  h("button", { type: "submit" }, "filter"),
  h("button", { type: "button", onclick: () => { Object.keys(auditFilters).forEach((k) => { auditFilters[k] = ""; }); refresh(); } }, "clear"));
  let records;
  const asked = current;
  try {
    ({ records } = await getJSON(`/api/audit?${query}`));
  } catch (err) {
    if (current !== asked) return;
    fill(main, h("h2", {}, "Audit"), form, h("p", { class: "error", id: "audit-error" }, err.message));
    return;
  }
  if (current !== asked) return;
  const filtered = Object.values(auditFilters).some(Boolean);
  fill(main, h("h2", {}, "Audit"), form, records.length ? auditTable(records, true)
    : h("p", { class: "muted" }, filtered ? "no actions recorded match these filters" : "no actions recorded"));
}

route();
connect();
