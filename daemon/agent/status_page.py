"""The status page served at `/`: one self-contained HTML document (no CDN, no build step).

It draws everything from `/api/status` (see `daemon/observe/status.py`), fetched on load and
then every `REFRESH_MS`: step/ETA, an inline-SVG loss curve (the validation loss drawn on it
in orange), throughput, the committed
checkpoints, the tiers (the memory tier's bytes, local and replica, the newest memory and
durable steps), per-rank heartbeats, the hangs (the ranks hung now, every rank of the last
declared hang), the stragglers (named now, the newest episodes), the last error, the last
rank failures and the last incidents (what, where, detection and recovery seconds, steps lost,
restore source, state). Elements carry ids (`step`, `eta`, `loss-curve`, `val-loss`,
`val-loss-line`, `checkpoints`, `tiers`, `memory-step`, `durable-step`, `memory-bytes`, `ranks`,
`hung-ranks`, `last-hang`, `straggler-ranks`, `stragglers`, `last-error`, `failures`,
`incidents`) so tests and scripts can read the rendered page.
"""

from __future__ import annotations

__all__ = ["PAGE", "REFRESH_MS"]

REFRESH_MS = 2000
"""How often the page re-reads `/api/status`."""

PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8">
<title>trainingd status</title>
<meta name="viewport" content="width=device-width, initial-scale=1">
<style>
body{font:14px/1.4 system-ui,sans-serif;margin:1.5em;color:#222;background:#fafafa}
h1{font-size:1.3em;margin:0 0 .5em} h2{font-size:1.05em;margin:1.2em 0 .4em}
.cards{display:flex;gap:1em;flex-wrap:wrap}
.card{background:#fff;border:1px solid #ddd;border-radius:6px;padding:.6em 1em;min-width:9em}
.card b{display:block;font-size:1.4em}
table{border-collapse:collapse;background:#fff} td,th{border:1px solid #ddd;padding:.25em .7em}
th{background:#f0f0f0;text-align:left} td.n{text-align:right;font-variant-numeric:tabular-nums}
svg{background:#fff;border:1px solid #ddd;border-radius:6px}
#last-error{color:#a00} .muted{color:#777}
</style></head>
<body data-loaded="0">
<h1>trainingd <span id="phase" class="muted">connecting...</span></h1>
<div class="cards">
 <div class="card">step<b id="step">-</b></div>
 <div class="card">ETA<b id="eta">-</b></div>
 <div class="card">loss<b id="loss">-</b></div>
 <div class="card">val loss<b id="val-loss">-</b></div>
 <div class="card">throughput<b id="throughput">-</b></div>
 <div class="card">restarts<b id="restarts">-</b></div>
</div>
<h2>Loss</h2>
<svg id="loss-curve" width="720" height="240" viewBox="0 0 720 240" data-points="0">
 <polyline id="loss-line" fill="none" stroke="#1f6feb" stroke-width="1.5" points=""></polyline>
 <polyline id="val-loss-line" fill="none" stroke="#d9480f" stroke-width="1.5" points=""
  data-points="0"></polyline>
 <text id="loss-max" x="4" y="14" font-size="11" fill="#777"></text>
 <text id="loss-min" x="4" y="234" font-size="11" fill="#777"></text>
</svg>
<h2>Tiers</h2>
<div class="cards" id="tiers">
 <div class="card">newest memory step<b id="memory-step">-</b></div>
 <div class="card">newest durable step<b id="durable-step">-</b></div>
 <div class="card">memory tier (local / replica)<b id="memory-bytes">-</b></div>
</div>
<h2>Checkpoints <span id="ckpt-uri" class="muted"></span></h2>
<table id="checkpoints"><thead><tr><th>step</th><th>size</th><th>age</th></tr></thead>
<tbody></tbody></table>
<h2>Ranks</h2>
<table id="ranks"><thead><tr><th>rank</th><th>local</th><th>pid</th><th>phase</th>
<th>step</th><th>restart</th><th>heartbeat age</th></tr></thead><tbody></tbody></table>
<h2>Hangs</h2>
<div>hung now: <b id="hung-ranks">none</b></div>
<table id="last-hang"><thead><tr><th>rank</th><th>node</th><th>role</th><th>phase</th>
<th>step</th><th>state</th><th>innermost frame</th><th>without progress</th><th>when</th>
</tr></thead><tbody></tbody></table>
<h2>Stragglers</h2>
<div>stragglers now: <b id="straggler-ranks">none</b></div>
<table id="stragglers"><thead><tr><th>rank</th><th>node</th><th>score</th>
<th>median compute</th><th>named</th><th>recovered</th><th>restarted</th>
</tr></thead><tbody></tbody></table>
<h2>Last error</h2><div id="last-error" class="muted">none</div>
<h2>Rank failures</h2>
<table id="failures"><thead><tr><th>when</th><th>rank</th><th>node</th><th>attempt</th>
<th>reason</th><th>step</th><th>error</th></tr></thead><tbody></tbody></table>
<h2>Incidents</h2>
<table id="incidents"><thead><tr><th>#</th><th>when</th><th>what</th><th>where</th>
<th>cause</th><th>detection</th><th>recovery</th><th>steps lost</th><th>source</th>
<th>state</th></tr></thead><tbody></tbody></table>
<script>
"use strict";
const $ = (id) => document.getElementById(id);
function dur(s) {
  if (s === null || s === undefined) return "-";
  s = Math.round(s);
  const h = Math.floor(s / 3600), m = Math.floor(s % 3600 / 60), r = s % 60;
  return (h ? h + "h " : "") + (h || m ? m + "m " : "") + r + "s";
}
function bytes(n) {
  const u = ["B", "KiB", "MiB", "GiB", "TiB"]; let i = 0;
  while (n >= 1024 && i < u.length - 1) { n /= 1024; i++; }
  return n.toFixed(i ? 1 : 0) + " " + u[i];
}
function rows(tbody, items, cells) {
  tbody.replaceChildren(...items.map((it) => {
    const tr = document.createElement("tr");
    for (const [text, num] of cells(it)) {
      const td = document.createElement("td"); td.textContent = text;
      if (num) td.className = "n"; tr.appendChild(td);
    }
    return tr;
  }));
}
function curve(points, val) {
  const svg = $("loss-curve"), W = 720, H = 240, P = 20;
  svg.dataset.points = String(points.length);
  $("val-loss-line").dataset.points = String(val.length);
  if (points.length < 2) {
    $("loss-line").setAttribute("points", ""); $("val-loss-line").setAttribute("points", "");
    return;
  }
  // One scale for both series: the validation points sit on the training curve's axes.
  const all = points.concat(val);
  const xs = all.map((p) => p[0]), ys = all.map((p) => p[1]);
  const x0 = Math.min(...xs), x1 = Math.max(...xs), y0 = Math.min(...ys), y1 = Math.max(...ys);
  const sx = (x) => P + (W - 2 * P) * (x - x0) / Math.max(1e-9, x1 - x0);
  const sy = (y) => H - P - (H - 2 * P) * (y - y0) / Math.max(1e-9, y1 - y0);
  $("loss-line").setAttribute("points",
    points.map((p) => sx(p[0]).toFixed(1) + "," + sy(p[1]).toFixed(1)).join(" "));
  $("val-loss-line").setAttribute("points",
    val.map((p) => sx(p[0]).toFixed(1) + "," + sy(p[1]).toFixed(1)).join(" "));
  $("loss-max").textContent = y1.toFixed(4);
  $("loss-min").textContent = y0.toFixed(4) + "  (steps " + x0 + "-" + x1 + ")";
}
function render(s) {
  $("phase").textContent = s.node.phase || "starting";
  $("step").textContent = "step " + (s.step === null ? "-" : s.step) + "/" + s.max_steps;
  $("eta").textContent = dur(s.eta_s);
  const last = s.loss.length ? s.loss[s.loss.length - 1][1] : null;
  $("loss").textContent = last === null ? "-" : last.toFixed(4);
  $("throughput").textContent = Math.round(s.tokens_per_s).toLocaleString("en") + " tok/s";
  $("restarts").textContent = String(s.node.restarts ?? 0);
  const lastVal = s.val_loss.length ? s.val_loss[s.val_loss.length - 1] : null;
  $("val-loss").textContent = lastVal === null ? "-" : lastVal[1].toFixed(4) + " @" + lastVal[0];
  curve(s.loss, s.val_loss);
  const t = s.tiers, num = (x) => x === null || x === undefined ? "-" : String(x);
  $("memory-step").textContent = num(t.newest_memory_step);
  $("durable-step").textContent = num(t.newest_durable_step);
  $("memory-bytes").textContent =
    bytes(t.memory_local_bytes) + " / " + bytes(t.memory_replica_bytes);
  const ck = s.checkpoints;
  $("ckpt-uri").textContent = ck.uri + (ck.error ? " (" + ck.error + ")" : "");
  rows($("checkpoints").tBodies[0], s.checkpoints.committed.slice().reverse(),
    (c) => [[String(c.step), true], [bytes(c.size_bytes), true], [dur(c.age_s) + " ago", true]]);
  rows($("ranks").tBodies[0], s.ranks, (r) => [[String(r.rank), true], [String(r.local_rank), true],
    [String(r.pid), true], [r.phase, false], [String(r.step), true], [String(r.restart), true],
    [r.heartbeat_age_s === null ? "-" : r.heartbeat_age_s.toFixed(1) + " s", true]]);
  const hung = s.hangs.hung_ranks;
  $("hung-ranks").textContent = hung.length ? "rank " + hung.join(", rank ") : "none";
  rows($("last-hang").tBodies[0], s.hangs.last, (h) => [[String(h.rank), true],
    [String(h.node), true], [h.cause ? "hung" : "waiting", false], [h.phase, false],
    [String(h.step), true], [h.stopped ? "stopped" : "running", false], [h.frame || "-", false],
    [h.seconds_without_progress.toFixed(1) + " s", true],
    [dur(s.now_unix_s - h.unix_s) + " ago", true]]);
  const slow = s.stragglers.ranks;
  $("straggler-ranks").textContent = slow.length ? "rank " + slow.join(", rank ") : "none";
  rows($("stragglers").tBodies[0], s.stragglers.recent, (g) => [[String(g.rank), true],
    [String(g.node), true], [g.score.toFixed(2), true],
    [(g.compute_s * 1000).toFixed(1) + " ms", true], [dur(s.now_unix_s - g.unix_s) + " ago", true],
    [g.recovered_unix_s === null ? "not yet" : dur(s.now_unix_s - g.recovered_unix_s) + " ago",
      true],
    [g.restarted ? "yes" : "no", false]]);
  const e = s.last_error;
  const ago = e ? " (" + dur(s.now_unix_s - e.unix_s) + " ago)" : "";
  $("last-error").textContent = e ? e.message + ago : "none";
  rows($("failures").tBodies[0], (s.failures || []).slice().reverse(), (f) => [
    [dur(s.now_unix_s - f.unix_s) + " ago", true], [String(f.rank), true],
    [String(f.node), true], [String(f.restart + 1), true], [f.reason, false],
    [f.step === null ? "-" : String(f.step), true],
    [f.exc_type ? f.exc_type + ": " + f.message
      : (f.signal ? "killed by " + f.signal : "exit code " + f.exit_code), false]]);
  const secs = (x) => x === null ? "-" : x.toFixed(1) + " s";
  rows($("incidents").tBodies[0], s.incidents || [], (i) => [[String(i.id), true],
    [dur(s.now_unix_s - i.detected_unix_s) + " ago", true], [i.kind, false],
    [(i.ranks.length ? "rank " + i.ranks.join(", ") + " " : "") + "node " + i.node, false],
    [i.cause, false], [secs(i.detection_s), true], [secs(i.recovery_s), true],
    [i.steps_lost === null ? "-" : String(i.steps_lost), true], [i.source || "-", false],
    [i.state, false]]);
}
async function refresh() {
  try {
    const resp = await fetch("/api/status", {cache: "no-store"});
    render(await resp.json());
    document.body.dataset.loaded = "1";
  } catch (err) {
    $("phase").textContent = "unreachable (" + err + ")";
  }
}
refresh();
setInterval(refresh, __REFRESH_MS__);
</script>
</body></html>
""".replace("__REFRESH_MS__", str(REFRESH_MS))
