// shoal dashboard: polls /api/state once a second and redraws. Hand-written, no libraries.
// Every string from the run (worker names, devices, event fields) is escaped before use.
"use strict";

const POLL_MS = 1000;
const params = new URLSearchParams(location.search);
const token = params.get("token");

function esc(s) {
  return String(s == null ? "" : s).replace(/[&<>"']/g, c => ({"&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;"}[c]));
}

function fmtNum(x, digits) {
  if (x == null || !isFinite(x)) return "-";
  return Number(x).toFixed(digits);
}

function fmtSecs(s) {
  if (s == null || !isFinite(s)) return "-";
  if (s < 1) return (s * 1000).toFixed(0) + " ms";
  if (s < 120) return s.toFixed(2) + " s";
  if (s < 7200) return (s / 60).toFixed(1) + " min";
  return (s / 3600).toFixed(1) + " h";
}

function fmtBytes(b) {
  if (b == null || !isFinite(b)) return "-";
  const units = ["B", "kB", "MB", "GB", "TB"];
  let i = 0;
  while (b >= 1000 && i < units.length - 1) { b /= 1000; i++; }
  return b.toFixed(i ? 1 : 0) + " " + units[i];
}

function fmtRate(bps) {  // bytes/s -> Mbit/s
  if (bps == null || !isFinite(bps)) return "-";
  return (bps * 8 / 1e6).toFixed(bps * 8 < 1e7 ? 1 : 0) + " Mbit/s";
}

function fmtFlops(f) {
  if (f == null || !isFinite(f) || f <= 0) return "-";
  const units = [[1e12, "TFLOP/s"], [1e9, "GFLOP/s"], [1e6, "MFLOP/s"]];
  for (const [v, u] of units) if (f >= v) return (f / v).toFixed(1) + " " + u;
  return f.toFixed(0) + " FLOP/s";
}

// ------------------------------------------------------------------ charts

// Axis ticks at 1, 2 or 5 x 10^k, and the decimals that step needs (0.05 -> 2, 0.2 -> 1, 5 -> 0).
function niceTicks(lo, hi, n) {
  const raw = (hi - lo) / Math.max(n, 1);
  const mag = Math.pow(10, Math.floor(Math.log10(raw)));
  const step = [1, 2, 5, 10].map(f => f * mag).find(s => s >= raw) || 10 * mag;
  const first = Math.ceil(lo / step - 1e-9) * step;
  const ticks = [];
  for (let v = first; v <= hi + step * 1e-9; v += step) ticks.push(v);
  return {ticks: ticks, digits: Math.max(0, -Math.floor(Math.log10(step) + 1e-9))};
}

function lineChart(el, points, label, digits) {
  el.dataset.points = String(points.length);
  const W = 520, H = 200, L = 58, R = 12, T = 12, B = 28;
  if (!points.length) {
    el.innerHTML = `<svg viewBox="0 0 ${W} ${H}" role="img" aria-label="${esc(label)}"><text x="${W / 2}" y="${H / 2}" text-anchor="middle" fill="#8a96a3">no committed step yet</text></svg>`;
    return;
  }
  const xs = points.map(p => p[0]), ys = points.map(p => p[1]).filter(y => y != null);
  let x0 = Math.min(...xs), x1 = Math.max(...xs);
  let y0 = Math.min(...ys), y1 = Math.max(...ys);
  if (x1 === x0) x1 = x0 + 1;
  if (y1 === y0) { y0 -= Math.abs(y0) * 0.05 + 1e-6; y1 += Math.abs(y1) * 0.05 + 1e-6; }
  const pad = (y1 - y0) * 0.06;
  y0 = (y0 >= 0 && y0 - pad < 0) ? 0 : y0 - pad; y1 += pad;
  const sx = x => L + (x - x0) / (x1 - x0) * (W - L - R);
  const sy = y => T + (1 - (y - y0) / (y1 - y0)) * (H - T - B);
  const path = points.filter(p => p[1] != null).map((p, i) => (i ? "L" : "M") + sx(p[0]).toFixed(1) + "," + sy(p[1]).toFixed(1)).join(" ");
  const dots = points.length <= 80 ? points.filter(p => p[1] != null).map(p => `<circle class="pt" cx="${sx(p[0]).toFixed(1)}" cy="${sy(p[1]).toFixed(1)}" r="2.5" fill="#123c5a"/>`).join("") : "";
  let grid = "";
  const axis = niceTicks(y0, y1, 4);
  for (const y of axis.ticks) {
    grid += `<line x1="${L}" x2="${W - R}" y1="${sy(y).toFixed(1)}" y2="${sy(y).toFixed(1)}" stroke="#eef1f4"/>` +
            `<text class="tick" x="${L - 6}" y="${(sy(y) + 4).toFixed(1)}" text-anchor="end" font-size="11" fill="#4a5a6a">${fmtNum(y, axis.digits)}</text>`;
  }
  const last = points[points.length - 1];
  el.innerHTML = `<svg viewBox="0 0 ${W} ${H}" role="img" aria-label="${esc(label)}">${grid}
    <line x1="${L}" x2="${L}" y1="${T}" y2="${H - B}" stroke="#9aa7b4"/>
    <line x1="${L}" x2="${W - R}" y1="${H - B}" y2="${H - B}" stroke="#9aa7b4"/>
    <text x="${L}" y="${H - 8}" font-size="11" fill="#4a5a6a">step ${x0}</text>
    <text x="${W - R}" y="${H - 8}" font-size="11" text-anchor="end" fill="#4a5a6a">step ${last[0]}: ${esc(label)} ${fmtNum(last[1], digits)}</text>
    <path d="${path}" fill="none" stroke="#2f7fc1" stroke-width="2"/>${dots}</svg>`;
}

// ------------------------------------------------------------------ plan diagram

function planDiagram(el, st) {
  const stages = st.stages, workers = st.workers.filter(w => w.state !== "gone");
  const n = Math.max(stages.length, 1);
  const BW = 200, GAP = 60, W = n * BW + (n - 1) * GAP + 20;
  const perStage = stages.map(s => workers.filter(w => w.stage === s.stage));
  const rows = Math.max(1, ...perStage.map(ws => ws.length));
  const H = 96 + rows * 26 + 14;
  let svg = `<svg viewBox="0 0 ${W} ${H}" style="max-width:${W}px" role="img" aria-label="plan">`;
  svg += `<defs><marker id="arr" markerWidth="8" markerHeight="8" refX="7" refY="4" orient="auto"><path d="M0,0 L8,4 L0,8 z" fill="#4a5a6a"/></marker></defs>`;
  stages.forEach((s, i) => {
    const x = 10 + i * (BW + GAP);
    const hot = s.bottleneck;
    svg += `<g class="stage-box" data-stage="${s.stage}">`;
    svg += `<rect x="${x}" y="8" width="${BW}" height="70" rx="6" fill="${hot ? "#fde8dc" : "#e7f0f8"}" stroke="${hot ? "#c2410c" : "#2f7fc1"}" stroke-width="${hot ? 2.5 : 1.5}"/>`;
    svg += `<text x="${x + 10}" y="28" font-weight="600" font-size="13">stage ${s.stage}${hot ? " \u2014 bottleneck" : ""}</text>`;
    svg += `<text x="${x + 10}" y="46" font-size="12">layers [${s.layers ? s.layers[0] + ", " + s.layers[1] : "?"})</text>`;
    svg += `<text x="${x + 10}" y="64" font-size="12">server ${esc(s.server || "(vacant)")} ${esc(s.server_address || "")}</text>`;
    svg += `</g>`;
    if (i < stages.length - 1) {
      svg += `<line x1="${x + BW + 4}" y1="36" x2="${x + BW + GAP - 6}" y2="36" stroke="#4a5a6a" stroke-width="1.5" marker-end="url(#arr)"/>`;
      svg += `<line x1="${x + BW + GAP - 4}" y1="52" x2="${x + BW + 6}" y2="52" stroke="#9aa7b4" stroke-width="1.5" stroke-dasharray="4 3" marker-end="url(#arr)"/>`;
    }
    if (perStage[i].length) {
      const yEnd = 92 + (perStage[i].length - 1) * 26 + 10;
      svg += `<line x1="${x + 12}" y1="78" x2="${x + 12}" y2="${yEnd}" stroke="#c8d0d8"/>`;
    }
    perStage[i].forEach((w, j) => {
      const y = 92 + j * 26;
      const fill = w.state === "active" ? "#d8f3e0" : "#fff1c9";
      svg += `<line x1="${x + 12}" y1="${y + 10}" x2="${x + 20}" y2="${y + 10}" stroke="#c8d0d8"/>`;
      svg += `<rect class="worker-chip" data-worker="${esc(w.name)}" x="${x + 20}" y="${y}" width="${BW - 40}" height="20" rx="10" fill="${fill}" stroke="#9aa7b4"/>`;
      svg += `<text x="${x + BW / 2}" y="${y + 14}" text-anchor="middle" font-size="12">${esc(w.name)} \u00b7 ${esc(w.device)} \u00b7 ${w.tasks_done} tasks</text>`;
    });
  });
  svg += `</svg>`;
  el.innerHTML = svg;
}

// ------------------------------------------------------------------ tables

function splitBar(sp) {
  if (!sp || !sp.total_s) return `<span class="muted">no step yet</span>`;
  const W = 220, H = 14, parts = ["compute", "transfer", "sync", "waiting"];
  let x = 0, rects = "";
  for (const p of parts) {
    const w = W * (sp[p + "_s"] || 0) / sp.total_s;
    rects += `<rect class="${p}" x="${x.toFixed(1)}" y="0" width="${Math.max(w, 0).toFixed(1)}" height="${H}"><title>${p} ${fmtSecs(sp[p + "_s"])}</title></rect>`;
    x += w;
  }
  const txt = parts.map(p => fmtSecs(sp[p + "_s"])).join(" / ");
  return `<svg class="bar" width="${W}" height="${H}" viewBox="0 0 ${W} ${H}">${rects}</svg> <span class="muted">${fmtSecs(sp.total_s)}: ${txt}</span>`;
}

function stagesTable(tbody, st) {
  tbody.innerHTML = st.stages.map(s => `<tr class="stage" data-stage="${s.stage}">
    <td>${s.stage}</td><td>[${s.layers ? s.layers[0] + ", " + s.layers[1] : "?"})</td>
    <td>${esc(s.server || "(vacant)")}</td><td>${esc(s.workers.join(", ") || "-")}</td>
    <td class="num">${s.step == null ? "-" : s.step}</td><td class="num">${s.pool_todo == null ? "-" : s.pool_todo}</td>
    <td class="num">${s.pool_waiting == null ? "-" : s.pool_waiting}</td><td class="num">${s.leases == null ? "-" : s.leases}</td>
    <td>${splitBar(s.split)}</td><td>${s.bottleneck ? '<span class="badge">bottleneck</span>' : ""}</td>
    <td class="waiting">${s.waiting_for ? esc(s.waiting_for.who) + ` <span class="muted">for ${fmtSecs(s.waiting_for.for_s)}</span>` : "-"}</td></tr>`).join("");
}

function linkText(l) {
  if (!l) return '<span class="muted">not measured</span>';
  let t = `${l.region ? esc(l.region) + " " : ""}up ${fmtRate(l.up_Bps)} down ${fmtRate(l.down_Bps)}`;
  if (l.measured && l.server) {
    t += ` \u00b7 to ${esc(l.server)}: rtt ${fmtSecs(l.rtt_s)}, up ${fmtRate(l.server_up_Bps)}, down ${fmtRate(l.server_down_Bps)}`;
  } else if (l.latency_s != null) {
    t += ` \u00b7 to ${esc(l.server)} ${fmtSecs(l.latency_s)}, ${fmtRate(l.bandwidth_Bps)}`;
  }
  if (l.paths) {
    const all = l.paths.map(p => `${esc(p.peer)} rtt ${fmtSecs(p.rtt_s)} up ${fmtRate(p.up_Bps)} down ${fmtRate(p.down_Bps)}`).join("\n");
    t = `<span title="${all}">${t}</span>`;
  }
  return t;
}

function workersTable(tbody, st) {
  tbody.innerHTML = st.workers.map(w => `<tr class="worker ${w.state}" data-worker="${esc(w.name)}" data-state="${w.state}">
    <td>${esc(w.name)}</td><td><span class="state ${w.state}">${w.state}</span>${w.why ? ` <span class="muted why">${esc(w.why)}</span>` : ""}</td>
    <td class="device">${esc(w.device)}</td><td class="num">${w.stage >= 0 ? w.stage : "-"}</td><td class="num">${fmtFlops(w.flops)}</td>
    <td class="num">${w.tasks_done}</td><td class="num">${fmtSecs(w.mean_task_s)}</td>
    <td class="num">${fmtSecs(w.last_seen_s)} ago</td><td class="num">${fmtBytes(w.bytes && w.bytes.wire)}</td>
    <td>${linkText(w.link)}</td></tr>`).join("");
}

function eventText(e) {
  const skip = new Set(["event", "time_s"]);
  return Object.keys(e).filter(k => !skip.has(k)).map(k => {
    const v = e[k];
    return esc(k) + "=" + esc(typeof v === "object" ? JSON.stringify(v) : v);
  }).join(" ");
}

function eventsList(ol, st) {
  ol.innerHTML = st.events.slice().reverse().slice(0, 100).map(e =>
    `<li class="${esc(e.event)}"><span class="t">${fmtNum(e.time_s, 1)} s</span><b>${esc(e.event)}</b> ${eventText(e)}</li>`).join("");
}

function summary(el, st) {
  const r = st.run, t = st.step_time;
  const state = r.done ? "done" : r.ready ? "training" : "waiting for members";
  const lastLoss = st.loss.length ? st.loss[st.loss.length - 1][1] : null;
  const live = st.workers.filter(w => w.state !== "gone").length;
  el.innerHTML = `<b>${esc(state)}</b> \u00b7 model ${esc(r.model)} \u00b7 step ${r.committed}/${r.steps}` +
    ` \u00b7 epoch ${r.epoch} \u00b7 loss ${fmtNum(lastLoss, 4)} \u00b7 ${live}/${st.workers.length} workers live` +
    ` \u00b7 re-queued ${r.requeues} \u00b7 step time predicted ${fmtSecs(t.predicted_s)}, achieved ${fmtSecs(t.achieved_s)}` +
    (r.done ? "" : ` \u00b7 <span id="eta">ETA ${r.eta_s == null ? "-" : fmtSecs(r.eta_s)}</span> to step ${r.steps}`) +
    ` \u00b7 plan ${esc(r.plan_method)}${r.scenario ? " \u00b7 scenario " + esc(r.scenario) : ""} \u00b7 ${fmtSecs(r.elapsed_s)} elapsed`;
  el.dataset.committed = String(r.committed);
}

function render(st) {
  summary(document.getElementById("summary"), st);
  planDiagram(document.getElementById("plan"), st);
  lineChart(document.getElementById("loss-chart"), st.loss, "loss", 4);
  lineChart(document.getElementById("tps-chart"), st.tokens_per_s, "tokens/s", 0);
  stagesTable(document.querySelector("#stages tbody"), st);
  workersTable(document.querySelector("#workers tbody"), st);
  eventsList(document.getElementById("events"), st);
}

// A page saved with the run's final state (RUN/dashboard.html) renders it and never polls.
function showSaved(st) {
  render(st);
  const conn = document.getElementById("conn");
  conn.textContent = "the run's final state, saved when it ended";
  conn.className = "conn";
}

async function poll() {
  const conn = document.getElementById("conn");
  try {
    const headers = token ? {"Authorization": "Bearer " + token} : {};
    const res = await fetch("api/state", {headers: headers, cache: "no-store"});
    if (!res.ok) throw new Error("HTTP " + res.status + (res.status === 401 ? " (add ?token=... to the URL)" : ""));
    render(await res.json());
    conn.textContent = "updated " + new Date().toLocaleTimeString();
    conn.className = "conn";
  } catch (err) {
    conn.textContent = "no update: " + err.message + " (the run may have finished)";
    conn.className = "conn bad";
  } finally {
    setTimeout(poll, POLL_MS);
  }
}

if (window.SHOAL_STATE) showSaved(window.SHOAL_STATE); else poll();
