// The valem sandbox page: approve a pairing, then watch and edit the paired session's models.
// Plain script, no dependencies: everything goes to this daemon's REST API and WebSocket with the
// session's token (X-Session-Token; `?session=` on the WebSocket handshake).
"use strict";

const $ = (id) => document.getElementById(id);
const TOKEN_KEY = "valem.sandbox.session";
let token = sessionStorage.getItem(TOKEN_KEY);
let current = null; // the selected model id
let currentView = null; // the selected view id
let socket = null;
let listTimer = null;
let spec = null; // the selected model's spec (schema and whether it has a view)

function el(tag, attrs, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === undefined || v === null || v === false) continue;
    if (k === "text") e.textContent = v;
    else if (k.startsWith("on")) e.addEventListener(k.slice(2), v);
    else e.setAttribute(k, v === true ? "" : String(v));
  }
  for (const c of children) if (c !== null && c !== undefined) e.append(c);
  return e;
}

async function api(method, path, body) {
  const headers = { Accept: "application/json" };
  if (token) headers["X-Session-Token"] = token;
  if (body !== undefined) headers["Content-Type"] = "application/json";
  const res = await fetch(path, { method, headers, body: body === undefined ? undefined : JSON.stringify(body) });
  let data = null;
  try { data = await res.json(); } catch (_) { data = null; }
  return { status: res.status, ok: res.ok, data };
}

function show(section) {
  for (const s of ["pairing", "unpaired", "workspace"]) $(s).hidden = s !== section;
}

function setBadge(text, cls) {
  const b = $("badge");
  b.textContent = text;
  b.className = "badge" + (cls ? " " + cls : "");
}

function fmt(v) {
  if (v === null || v === undefined) return "—";
  if (typeof v === "number") return Number.isInteger(v) ? String(v) : String(Math.round(v * 1e6) / 1e6);
  if (typeof v === "object") return JSON.stringify(v);
  return String(v);
}

// --- pairing ------------------------------------------------------------------------------

async function startPairing(pairCode, userCode) {
  show("pairing");
  $("user-code").value = userCode || "";
  const peek = await api("GET", "/sandbox/pair/" + encodeURIComponent(pairCode));
  if (!peek.ok || peek.data.status !== "pending") {
    $("pair-error").textContent = peek.data && peek.data.message ? peek.data.message : "This pairing is no longer waiting for approval.";
    $("approve").disabled = true;
    return;
  }
  $("pair-expiry").textContent = "The link expires in " + Math.ceil(peek.data.expiresInSec / 60) + " min.";
  $("pair-form").onsubmit = async (ev) => {
    ev.preventDefault();
    $("pair-error").textContent = "";
    const r = await api("POST", "/sandbox/pair/approve", { pairCode, userCode: $("user-code").value });
    if (!r.ok) {
      $("pair-error").textContent = (r.data && r.data.message) || "Approval failed (HTTP " + r.status + ")";
      if (r.status !== 403 || !(r.data && r.data.attemptsLeft)) $("approve").disabled = true;
      return;
    }
    token = r.data.sessionToken;
    sessionStorage.setItem(TOKEN_KEY, token);
    openWorkspace();
  };
  $("deny").onclick = async () => {
    await api("POST", "/sandbox/pair/deny", { pairCode });
    $("pair-error").textContent = "Pairing denied. You can close this tab.";
    $("approve").disabled = true;
    $("deny").disabled = true;
  };
  $("user-code").focus();
}

// --- the workspace ------------------------------------------------------------------------

async function openWorkspace() {
  const s = await api("GET", "/sandbox/session");
  if (s.status === 401) {
    sessionStorage.removeItem(TOKEN_KEY);
    token = null;
    setBadge("session ended", "warn");
    show("unpaired");
    return;
  }
  setBadge("paired", "paired");
  show("workspace");
  renderModelList(s.data.models || []);
  if (listTimer) clearInterval(listTimer);
  listTimer = setInterval(refreshList, 2000);
}

async function refreshList() {
  const s = await api("GET", "/sandbox/session");
  if (s.status === 401) { clearInterval(listTimer); return openWorkspace(); }
  if (s.ok) renderModelList(s.data.models || []);
}

function renderModelList(models) {
  const ul = $("model-list");
  const have = [...ul.querySelectorAll("button")].map((b) => b.dataset.id).join("\n");
  $("no-models").hidden = models.length > 0;
  if (have !== models.join("\n")) {
    ul.replaceChildren(...models.map((id) => el("li", {}, el("button", {
      type: "button", "data-id": id, "aria-current": id === current ? "true" : "false", text: id,
      onclick: () => selectModel(id),
    }))));
  }
  if (current && !models.includes(current)) {
    current = null;
    $("model-title").textContent = "Select a model";
    $("view").replaceChildren();
  }
}

function selectModel(id) {
  current = id;
  currentView = null;
  for (const b of $("model-list").querySelectorAll("button")) b.setAttribute("aria-current", b.dataset.id === id ? "true" : "false");
  $("model-title").textContent = id;
  $("explain-body").replaceChildren();
  spec = null;
  subscribe(id);
  render();
}

function subscribe(id) {
  if (socket) { socket.onclose = null; socket.close(); }
  const proto = location.protocol === "https:" ? "wss:" : "ws:";
  socket = new WebSocket(proto + "//" + location.host + "/models/" + encodeURIComponent(id) + "/subscribe?session=" + encodeURIComponent(token));
  socket.onmessage = (ev) => {
    if (current !== id) return;
    try { if (JSON.parse(ev.data).kind === "spec-evolved") spec = null; } catch (_) { /* a frame we do not know */ }
    render();
  };
  socket.onclose = () => { if (current === id) setTimeout(() => current === id && subscribe(id), 1000); };
}

async function render() {
  const id = current;
  if (!id) return;
  const enc = encodeURIComponent(id);
  if (!spec) {
    const s = await api("GET", "/models/" + enc + "/spec");
    if (id !== current) return;
    spec = s.ok ? s.data : {};
  }
  const hasView = !!(spec.viewDefinition && (spec.viewDefinition.views || []).length);
  const noView = { ok: false };
  const [view, state] = await Promise.all([
    hasView ? api("GET", "/models/" + enc + "/view" + (currentView ? "/" + encodeURIComponent(currentView) : "")) : noView,
    api("GET", "/models/" + enc + "/state"),
  ]);
  if (id !== current) return;
  $("state").textContent = state.ok ? JSON.stringify(state.data, null, 2) : "";
  $("view-error").textContent = "";
  const form = $("view");
  const focused = document.activeElement && document.activeElement.id;
  if (view.ok) {
    renderTabs(view.data);
    form.replaceChildren(...(view.data.components || []).map(renderComponent).filter(Boolean));
  } else {
    $("view-tabs").replaceChildren();
    if (hasView && view.data) $("view-error").textContent = view.data.message || view.data.error || "The view could not be evaluated";
    // No viewDefinition: the schema's top-level fields, editable unless derived or read-only.
    form.replaceChildren(...genericFields(spec, state.ok ? state.data : {}));
  }
  if (focused && $(focused)) $(focused).focus();
}

function renderTabs(v) {
  const views = v.views || [];
  $("view-tabs").replaceChildren(...(views.length > 1 ? views : []).map((x) => el("button", {
    type: "button", role: "tab", class: "tab", "aria-selected": x.id === v.viewId ? "true" : "false",
    text: x.title || x.id, onclick: () => { currentView = x.id; render(); },
  })));
}

let seq = 0;
const uid = (c) => "f-" + (c.id || "c") .replace(/[^A-Za-z0-9_-]/g, "_") + "-" + (++seq);

const INPUTS = new Set(["textField", "numericField", "numberField", "currencyField", "percentField", "slider",
  "sliderField", "checkboxField", "switchField", "toggle", "toggleField", "selectField", "radioField", "dateField",
  "textArea", "textAreaField", "emailField", "comboBox", "ratingField"]);
const NUMERIC = new Set(["numericField", "numberField", "currencyField", "percentField", "slider", "sliderField", "ratingField"]);
const BOOLEAN = new Set(["checkboxField", "switchField", "toggle", "toggleField"]);

function whyButton(bind) {
  if (!bind) return null;
  return el("button", { type: "button", class: "why", "aria-label": "Why is " + bind + " this value?", text: "why?", onclick: () => explain(bind) });
}

function renderComponent(c) {
  if (!c || c.visible === false) return null;
  const label = c.label || c.text || c.id || c.bind || "";
  if (Array.isArray(c.components)) {
    const fs = el("fieldset", { "data-component": c.id }, c.label ? el("legend", { text: c.label }) : null);
    for (const sub of c.components) { const r = renderComponent(sub); if (r) fs.append(r); }
    return fs;
  }
  if (Array.isArray(c.rows)) {
    const fs = el("fieldset", { "data-component": c.id }, el("legend", { text: label }));
    for (const row of c.rows) {
      const g = el("div", { class: "row-item" });
      for (const sub of row.components || []) { const r = renderComponent(sub); if (r) g.append(r); }
      fs.append(g);
    }
    return fs;
  }
  if (INPUTS.has(c.type) && c.bind) return renderInput(c, label);
  if ((c.type === "dataTable" || c.type === "dataChart") && Array.isArray(c.value)) return renderTable(c, label);
  if (c.type === "separatorLine" || c.type === "divider") return el("hr", {});
  if (c.type === "spacer") return el("div", { style: "height:" + (Number(c.size) || 16) + "px" });
  if (c.type === "button") return el("div", { class: "field" }, el("button", { type: "button", class: "secondary", disabled: true, title: "Actions run from the agent, not the sandbox", text: label }));
  if (Array.isArray(c.items)) {
    return el("dl", { class: "field", "data-component": c.id }, el("dt", { class: "muted", text: c.label || "" }),
      ...c.items.map((it) => el("dd", {}, el("span", { class: "muted", text: (it.label || it.bind || "") + ": " }),
        el("span", { class: "value", text: fmt(it.value !== undefined && it.value !== null ? it.value : it.text) }), " ",
        it.bind && !String(it.bind).includes("[*]") ? whyButton(it.bind) : null)));
  }
  if (c.type === "jsonViewer") return el("div", { class: "field" }, el("span", { class: "muted", text: label }), el("pre", { text: JSON.stringify(c.value, null, 2) }));
  const shown = c.value !== undefined ? c.value : c.text;
  return el("div", { class: "field", "data-component": c.id, "data-bind": c.bind },
    el("span", { class: "muted", text: (c.type === "label" && c.value === undefined ? "" : label) }), " ",
    el("span", { class: "value", text: c.type === "label" && c.value === undefined ? fmt(c.text || c.label) : fmt(shown) }), " ",
    c.bind && !String(c.bind).includes("[*]") ? whyButton(c.bind) : null);
}

function renderInput(c, label) {
  const id = uid(c);
  const err = el("p", { class: "error", role: "alert", id: id + "-err" });
  const readOnly = c.readOnly === true || c.enabled === false;
  let input;
  if (BOOLEAN.has(c.type)) {
    input = el("input", { type: "checkbox", id, disabled: readOnly });
    input.checked = c.value === true;
  } else if (Array.isArray(c.options) && c.options.length) {
    input = el("select", { id, disabled: readOnly },
      ...c.options.map((o) => {
        const value = typeof o === "object" && o !== null ? o.value : o;
        const opt = el("option", { value: JSON.stringify(value), text: typeof o === "object" && o !== null ? (o.label ?? fmt(o.value)) : fmt(o) });
        if (JSON.stringify(value) === JSON.stringify(c.value)) opt.selected = true;
        return opt;
      }));
  } else {
    const numeric = NUMERIC.has(c.type) || typeof c.value === "number";
    input = el(c.type === "textArea" || c.type === "textAreaField" ? "textarea" : "input", {
      id, type: numeric ? "number" : (c.type === "dateField" ? "date" : "text"), readonly: readOnly,
      step: numeric ? (c.step ?? "any") : undefined, min: c.min, max: c.max, required: c.required === true,
      "aria-describedby": id + "-err",
    });
    input.value = c.value === null || c.value === undefined ? "" : (typeof c.value === "object" ? JSON.stringify(c.value) : String(c.value));
  }
  input.dataset.bind = c.bind;
  const commit = () => {
    let v;
    if (input.type === "checkbox") v = input.checked;
    else if (input.tagName === "SELECT") v = JSON.parse(input.value);
    else if (input.type === "number") { if (input.value === "") return; v = Number(input.value); }
    else v = input.value;
    mutate(c.bind, v, input, err);
  };
  input.addEventListener("change", commit);
  return el("div", { class: "field", "data-component": c.id, "data-bind": c.bind },
    el("label", { for: id, text: label + (c.required === true ? " *" : "") }), input, err);
}

function renderTable(c, label) {
  const rows = c.value;
  const cols = Array.isArray(c.tableColumns) && c.tableColumns.length
    ? c.tableColumns.map((t) => (typeof t === "string" ? { key: t, label: t } : { key: t.key || t.field || t.bind, label: t.label || t.key || t.field }))
    : [...new Set(rows.flatMap((r) => (r && typeof r === "object" ? Object.keys(r) : [])))].map((k) => ({ key: k, label: k }));
  const key = (k) => String(k || "").replace(/^\$\.?/, "").replace(/^.*\]\./, "");
  return el("div", { class: "field", "data-component": c.id },
    el("table", {}, el("caption", { text: label }),
      el("thead", {}, el("tr", {}, ...cols.map((k) => el("th", { scope: "col", text: k.label })))),
      el("tbody", {}, ...rows.map((r) => el("tr", {}, ...cols.map((k) => el("td", { text: fmt(r && typeof r === "object" ? r[key(k.key)] : r) })))))));
}

function genericFields(spec, state) {
  const out = [el("p", { class: "muted", text: "This model has no view; its fields:" })];
  const props = (spec.schema && spec.schema.properties) || {};
  const derived = new Set((spec.derivations || []).map((d) => String(d.path || "")));
  const keys = [...new Set([...Object.keys(props), ...Object.keys(state || {})])];
  for (const k of keys) {
    const bind = "$." + k;
    const p = props[k] || {};
    const v = state ? state[k] : undefined;
    const t = p.type || typeof v;
    if (derived.has(bind) || p.readOnly || (v !== null && v !== undefined && typeof v === "object")) {
      out.push(el("div", { class: "field", "data-bind": bind }, el("span", { class: "muted", text: k }), " ",
        el("span", { class: "value", text: fmt(v) }), " ", derived.has(bind) ? whyButton(bind) : null));
    } else {
      const type = t === "boolean" ? "checkboxField" : (t === "number" || t === "integer" ? "numericField" : "textField");
      out.push(renderInput({ id: k, type, bind, value: v, min: p.minimum, max: p.maximum }, k));
    }
  }
  return out;
}

async function mutate(bind, value, input, err) {
  err.textContent = "";
  input.closest(".field").classList.remove("invalid");
  input.removeAttribute("aria-invalid");
  const r = await api("POST", "/models/" + encodeURIComponent(current) + "/mutations", { [bind]: value });
  if (!r.ok) {
    const d = r.data || {};
    const v = (d.violations || []).map((x) => x.message).filter(Boolean);
    err.textContent = (d.error || "Rejected") + (v.length ? ": " + v.join("; ") : (d.message ? ": " + d.message : ""));
    input.closest(".field").classList.add("invalid");
    input.setAttribute("aria-invalid", "true");
    return;
  }
  const flagged = r.data && r.data.flaggedConstraints;
  if (flagged && flagged.length) err.textContent = "Flagged: " + flagged.map((f) => f.message || f.constraintId || f).join("; ");
  render();
}

async function explain(bind) {
  const body = $("explain-body");
  $("explain-hint").hidden = true;
  const r = await api("GET", "/models/" + encodeURIComponent(current) + "/explain/" + encodeURIComponent(bind) + "?limit=5");
  if (!r.ok) { body.replaceChildren(el("p", { class: "error", text: (r.data && r.data.message) || "No explanation" })); return; }
  const traces = Array.isArray(r.data) ? r.data : [];
  if (!traces.length) { body.replaceChildren(el("p", { text: bind + " is a base field: it holds what was written." })); return; }
  body.replaceChildren(el("h3", { text: bind }), ...traces.map((t) => el("div", { class: "trace" },
    el("div", {}, el("code", { text: t.expression || "" })),
    el("div", {}, "= ", el("span", { class: "value", text: fmt(t.result) }), t.jit ? " (compiled)" : ""),
    t.inputPaths && t.inputPaths.length ? el("div", { class: "muted", text: "reads " + t.inputPaths.join(", ") }) : null,
    t.errorMessage ? el("div", { class: "error", text: t.errorMessage }) : null)));
}

// --- start ----------------------------------------------------------------------------------

(function start() {
  const frag = new URLSearchParams(location.hash.replace(/^#/, ""));
  const pairCode = frag.get("pair");
  if (pairCode) {
    // The code rides in the fragment (never sent to a server); drop it from the address bar and history.
    history.replaceState(null, "", location.pathname);
    startPairing(pairCode, frag.get("code"));
    return;
  }
  if (token) openWorkspace();
  else show("unpaired");
})();
