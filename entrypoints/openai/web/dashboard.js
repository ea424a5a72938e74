// The dashboard: every served model with its state, and for the one selected its stages (replicas,
// queues, waves, batch sizes, latency) and charts of the last minutes. Polls GET /v1/status (now)
// and GET /v1/status/history (the server's rolling window, only the samples not seen yet) every
// second. The charts are SVG drawn here; every value is set as text or as an SVG attribute.
"use strict";

(() => {
  const { api, errorText, byId, el } = Omni;
  const PERIOD_MS = 1000;
  const SVG_NS = "http://www.w3.org/2000/svg";
  // The chart's drawing box (SVG user units; the page scales it).
  const W = 360, H = 150, LEFT = 48, RIGHT = 8, TOP = 10, BOTTOM = 20;
  const COLOURS = 8; // style.css has .s0 to .s7
  let timer = null;
  let selected = decodeURIComponent(location.hash.slice(1)) || null;
  const windows = new Map(); // model -> its samples, oldest first
  let spanS = 600;
  let lastTime = null; // the newest sample's time: the next poll asks only for later ones
  let reports = []; // the latest /v1/status, a report per model

  // ------------------------------------------------------------------ formatting

  function ms(value) {
    return value === null || value === undefined ? "–" : value.toFixed(1) + " ms";
  }

  function num(value) {
    if (value === null || value === undefined) return "–";
    const a = Math.abs(value);
    return a >= 100 || Number.isInteger(value) ? value.toFixed(0) : a >= 10 ? value.toFixed(1) : value.toFixed(2);
  }

  function shortMs(value) {
    if (value === null || value === undefined) return "–";
    return value >= 1000 ? num(value / 1000) + " s" : num(value) + " ms";
  }

  function bytes(value) {
    if (value === null || value === undefined) return "–";
    const units = ["B", "KiB", "MiB", "GiB", "TiB"];
    let v = value, u = 0;
    while (v >= 1024 && u < units.length - 1) {
      v /= 1024;
      u++;
    }
    return num(v) + " " + units[u];
  }

  function counts(map) {
    const parts = Object.entries(map || {}).map(([k, v]) => k + " " + v);
    return parts.length ? parts.join(" · ") : "none";
  }

  function cssName(value) {
    return String(value).replace(/[^a-z]/g, "");
  }

  // ------------------------------------------------------------------ the models

  function latest(model) {
    const samples = windows.get(model) || [];
    return samples.length ? samples[samples.length - 1] : null;
  }

  // The latest end-to-end quantiles of a model: those of the last interval in which requests finished.
  function latency(model) {
    const samples = windows.get(model) || [];
    for (let i = samples.length - 1; i >= 0; i--) {
      if (samples[i].e2e_p50_ms !== null) return shortMs(samples[i].e2e_p50_ms) + " / " + shortMs(samples[i].e2e_p99_ms);
    }
    return "–";
  }

  // Every model's window is here already: a selection is drawn at once.
  function select(model) {
    selected = model;
    history.replaceState(null, "", "#" + encodeURIComponent(model));
    render();
  }

  function modelTable() {
    const body = byId("models").tBodies[0];
    body.replaceChildren();
    for (const r of reports) {
      const row = el("tr");
      row.dataset.model = r.model;
      if (r.model === selected) row.className = "selected";
      const button = el("button", r.model, "link");
      button.type = "button";
      button.dataset.model = r.model;
      button.addEventListener("click", () => select(r.model));
      const name = el("td");
      name.append(button);
      const state = el("span", r.state, "badge state-" + cssName(r.state));
      const stateCell = el("td");
      stateCell.append(state);
      const last = latest(r.model);
      row.append(
        name,
        stateCell,
        el("td", r.pending + " / " + r.max_pending),
        el("td", last ? num(last.requests_per_s) : "–"),
        el("td", latency(r.model)),
        el("td", r.loads + " · " + r.wakes + " · " + r.evictions),
        el("td", bytes(r.resident_bytes)),
      );
      body.append(row);
    }
  }

  // ------------------------------------------------------------------ a stage now

  function stat(label, value, name) {
    const box = el("div", null, "stat");
    box.append(el("span", label, "label"), el("span", value, "value " + name));
    return box;
  }

  function replicaTable(replicas) {
    const table = el("table", null, "replicas");
    const head = el("tr");
    for (const title of ["replica", "state", "node", "in flight", "waiting", "running", "waves"]) {
      head.append(el("th", title));
    }
    table.append(head);
    const show = (v) => (v === null || v === undefined ? "–" : v);
    for (const r of replicas) {
      const row = el("tr");
      row.append(
        el("td", r.replica_id),
        el("td", r.state, "state-" + cssName(r.state)),
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

  // ------------------------------------------------------------------ the charts

  function perStage(sample, key) {
    const out = {};
    for (const st of sample.stages) out["stage " + st.stage_id] = st[key];
    return out;
  }

  function perReplica(sample, key) {
    const out = {};
    for (const st of sample.stages) {
      st[key].forEach((value, replica) => {
        out["stage " + st.stage_id + " · replica " + replica] = value;
      });
    }
    return out;
  }

  // Each chart: the series one sample gives (name -> value; a missing or null value is a gap).
  const CHARTS = [
    { id: "requests", title: "Requests / s", format: num, series: (s) => ({ "finished / s": s.requests_per_s }) },
    {
      id: "latency",
      title: "Latency, end to end",
      format: shortMs,
      series: (s) => ({ mean: s.e2e_mean_ms, p50: s.e2e_p50_ms, p99: s.e2e_p99_ms }),
    },
    { id: "queue", title: "Queue depth", format: num, series: (s) => perReplica(s, "queue_depth") },
    { id: "batch", title: "Batch size", format: num, series: (s) => perStage(s, "batch_size") },
    { id: "waves", title: "Waves / s", format: num, series: (s) => perStage(s, "waves_per_s") },
    { id: "cache", title: "Cache hits / s", format: num, series: (s) => perStage(s, "cache_hits_per_s") },
    { id: "restarts", title: "Restarts", format: num, series: (s) => perStage(s, "restarts") },
    { id: "memory", title: "Resident weights", format: bytes, series: (s) => ({ resident: s.resident_bytes }) },
  ];

  function svg(tag, attrs, text) {
    const node = document.createElementNS(SVG_NS, tag);
    for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, String(v));
    if (text !== undefined) node.textContent = String(text);
    return node;
  }

  // A round top for the y axis: 1, 2 or 5 times a power of ten, at least the largest value.
  function roundUp(value) {
    if (!(value > 0)) return 1;
    const power = Math.pow(10, Math.floor(Math.log10(value)));
    for (const m of [1, 2, 5, 10]) if (m * power >= value) return m * power;
    return 10 * power;
  }

  function chart(def, samples, end) {
    const names = [];
    const data = new Map(); // series name -> value per sample (null: a gap)
    samples.forEach((sample, i) => {
      for (const [name, value] of Object.entries(def.series(sample))) {
        if (!data.has(name)) {
          data.set(name, new Array(samples.length).fill(null));
          names.push(name);
        }
        data.get(name)[i] = typeof value === "number" && Number.isFinite(value) ? value : null;
      }
    });
    let most = 0, points = 0;
    for (const values of data.values()) {
      for (const v of values) {
        if (v === null) continue;
        most = Math.max(most, v);
        points++;
      }
    }
    const top = roundUp(most);
    const x = (t) => LEFT + (W - LEFT - RIGHT) * Math.max(0, 1 - (end - t) / spanS);
    const y = (v) => TOP + (H - TOP - BOTTOM) * (1 - v / top);
    const root = svg("svg", { viewBox: "0 0 " + W + " " + H, role: "img", "aria-label": def.title });
    for (const frac of [0, 0.5, 1]) {
      const at = y(top * frac).toFixed(1);
      root.append(svg("line", { x1: LEFT, x2: W - RIGHT, y1: at, y2: at, class: "grid" }));
      root.append(svg("text", { x: LEFT - 4, y: at, class: "tick y" }, def.format(top * frac)));
    }
    root.append(svg("text", { x: LEFT, y: H - 4, class: "tick" }, "−" + Math.round(spanS / 60) + " min"));
    root.append(svg("text", { x: W - RIGHT, y: H - 4, class: "tick end" }, "now"));
    const legend = el("div", null, "legend");
    names.forEach((name, k) => {
      const colour = "s" + (k % COLOURS);
      const group = svg("g", { class: "series " + colour, "data-series": name });
      let run = [];
      const flush = () => {
        if (run.length > 1) group.append(svg("polyline", { points: run.map((p) => p.join(",")).join(" ") }));
        else if (run.length === 1) group.append(svg("circle", { cx: run[0][0], cy: run[0][1], r: 2.5 }));
        run = [];
      };
      data.get(name).forEach((v, i) => {
        if (v === null) flush();
        else run.push([x(samples[i].time).toFixed(1), y(v).toFixed(1)]);
      });
      flush();
      root.append(group);
      const values = data.get(name).filter((v) => v !== null);
      const item = el("span", null, "item");
      item.append(el("span", null, "swatch " + colour), el("span", name + " " + def.format(values.length ? values[values.length - 1] : null)));
      legend.append(item);
    });
    if (!names.length) legend.append(el("span", "no data yet", "muted"));
    const figure = el("figure", null, "chart card");
    figure.dataset.chart = def.id;
    figure.dataset.points = String(points);
    figure.append(el("figcaption", def.title), root, legend);
    return figure;
  }

  function charts(model) {
    const samples = windows.get(model) || [];
    const end = samples.length ? samples[samples.length - 1].time : Date.now() / 1000;
    const box = byId("charts");
    box.dataset.model = model;
    box.replaceChildren(...CHARTS.map((def) => chart(def, samples, end)));
  }

  // ------------------------------------------------------------------ polling

  function addSamples(windowReports) {
    for (const r of windowReports) {
      spanS = r.span_s || spanS;
      const samples = (windows.get(r.model) || []).concat(r.samples);
      const newest = samples.length ? samples[samples.length - 1].time : null;
      if (newest !== null) lastTime = lastTime === null ? newest : Math.max(lastTime, newest);
      windows.set(r.model, newest === null ? samples : samples.filter((s) => s.time > newest - spanS));
    }
  }

  function render() {
    if (!reports.some((r) => r.model === selected)) selected = reports.length ? reports[0].model : null;
    modelTable();
    const status = reports.find((r) => r.model === selected);
    if (!status) return;
    byId("model").textContent = status.model;
    const engine = byId("engine");
    engine.textContent = status.status + (status.draining ? " (draining)" : "");
    engine.className = "badge status-" + cssName(status.status);
    byId("pending").textContent = status.pending + " / " + status.max_pending;
    // One model: the server's latest requests; several: this model's latest interval with requests.
    byId("latency").textContent =
      reports.length === 1 && status.e2e_p50_ms !== null ? ms(status.e2e_p50_ms) + " / " + ms(status.e2e_p99_ms) : latency(status.model);
    const jobs = status.jobs;
    byId("jobs").textContent = jobs
      ? "now: " + counts(jobs.active) + " — since start: " + counts(jobs.reached) + " — stored: " + (jobs.stored ?? "–")
      : status.state === "loaded" ? "no job store" : "–";
    byId("updated").textContent = new Date(status.time * 1000).toLocaleTimeString();
    charts(status.model);
    const stages = status.stages.map(stageCard);
    if (!stages.length) stages.push(el("p", status.model + " is " + status.state + ": no stage runs now.", "muted"));
    byId("stages").replaceChildren(...stages);
  }

  async function poll() {
    timer = null;
    try {
      const since = lastTime === null ? "" : "?since=" + lastTime;
      const [now, past] = await Promise.all([api("/v1/status"), api("/v1/status/history" + since)]);
      if (!now.ok) throw new Error(await errorText(now));
      if (!past.ok) throw new Error(await errorText(past));
      const status = await now.json();
      const recent = await past.json();
      addSamples(recent.models || [recent]);
      reports = status.models || [status];
      render();
      byId("error").textContent = "";
    } catch (e) {
      if (e instanceof Omni.NeedKey) return; // polling starts again once a key is entered
      byId("error").textContent = e.message;
    }
    if (timer === null) timer = setTimeout(poll, PERIOD_MS);
  }

  window.addEventListener("hashchange", () => {
    const model = decodeURIComponent(location.hash.slice(1));
    if (model && model !== selected) select(model);
  });

  Omni.start(() => {
    if (timer !== null) clearTimeout(timer);
    poll();
  });
})();
