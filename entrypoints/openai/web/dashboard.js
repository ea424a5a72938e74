// The dashboard: polls GET /v1/status every second and draws each stage's replicas, queues, wave
// rate, batch sizes and latency. Every value is set as text.
"use strict";

(() => {
  const { api, errorText, byId, el } = Omni;
  const PERIOD_MS = 1000;
  let timer = null;

  function ms(value) {
    return value === null || value === undefined ? "–" : value.toFixed(1) + " ms";
  }

  function counts(map) {
    const parts = Object.entries(map || {}).map(([k, v]) => k + " " + v);
    return parts.length ? parts.join(" · ") : "none";
  }

  function stat(label, value, name) {
    const box = el("div", null, "stat");
    const v = el("span", value, "value " + name);
    box.append(el("span", label, "label"), v);
    return box;
  }

  function replicaTable(replicas) {
    const table = el("table", null, "replicas");
    const head = el("tr");
    for (const title of ["replica", "state", "node", "in flight", "waiting", "running", "waves"]) {
      head.append(el("th", title));
    }
    table.append(head);
    for (const r of replicas) {
      const row = el("tr");
      const show = (v) => (v === null || v === undefined ? "–" : v);
      row.append(
        el("td", r.replica_id),
        el("td", r.state, "state-" + String(r.state).replace(/[^a-z]/g, "")),
        el("td", show(r.node)),
        el("td", r.inflight),
        el("td", show(r.queue_len)),
        el("td", show(r.running)),
        el("td", show(r.waves)),
      );
      table.append(row);
    }
    return table;
  }

  function histogram(hist) {
    const box = el("div", null, "histogram");
    const entries = Object.entries(hist || {});
    if (!entries.length) box.append(el("span", "no waves yet", "muted"));
    const most = Math.max(1, ...entries.map(([, n]) => n));
    for (const [size, n] of entries) {
      const row = el("div", null, "bar");
      row.dataset.size = size;
      const meter = el("meter");
      meter.max = most;
      meter.value = n;
      row.append(el("span", "size " + size, "label"), meter, el("span", n, "count"));
      box.append(row);
    }
    return box;
  }

  function stageCard(s) {
    const card = el("section", null, "card stage");
    card.dataset.stage = String(s.stage_id);
    card.append(el("h2", "Stage " + s.stage_id + " · " + s.stage_type));
    const stats = el("div", null, "stats");
    stats.append(
      stat("queue depth", s.queue_depth, "queue-depth"),
      stat("in flight", s.inflight, "inflight"),
      stat("waves", s.waves, "waves"),
      stat("waves / s", s.waves_per_s.toFixed(2), "waves-per-s"),
      stat("wave p50", ms(s.wave_p50_ms), "wave-p50"),
      stat("wave p99", ms(s.wave_p99_ms), "wave-p99"),
      stat("restarts", s.restarts, "restarts"),
    );
    card.append(stats, el("h3", "Replicas"), replicaTable(s.replicas), el("h3", "Batch sizes"), histogram(s.batch_size_histogram));
    return card;
  }

  function render(status) {
    byId("model").textContent = status.model;
    const engine = byId("engine");
    engine.textContent = status.status + (status.draining ? " (draining)" : "");
    engine.className = "badge status-" + String(status.status).replace(/[^a-z]/g, "");
    byId("pending").textContent = status.pending + " / " + status.max_pending;
    byId("latency").textContent = ms(status.e2e_p50_ms) + " / " + ms(status.e2e_p99_ms);
    const jobs = status.jobs;
    byId("jobs").textContent = jobs
      ? "now: " + counts(jobs.active) + " — since start: " + counts(jobs.reached) + " — stored: " + (jobs.stored ?? "–")
      : "no job store";
    byId("updated").textContent = new Date(status.time * 1000).toLocaleTimeString();
    byId("stages").replaceChildren(...status.stages.map(stageCard));
  }

  async function poll() {
    timer = null;
    try {
      const r = await api("/v1/status");
      if (!r.ok) throw new Error(await errorText(r));
      render(await r.json());
      byId("error").textContent = "";
    } catch (e) {
      if (e instanceof Omni.NeedKey) return; // polling starts again once a key is entered
      byId("error").textContent = e.message;
    }
    timer = setTimeout(poll, PERIOD_MS);
  }

  Omni.start(() => {
    if (timer !== null) clearTimeout(timer);
    poll();
  });
})();
