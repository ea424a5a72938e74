// The playground: submit a job (POST /v1/generate), follow its events (SSE read with fetch, so that
// the key goes in a header), cancel it, show its result, and keep this browser's history.
"use strict";

(() => {
  const { api, errorText, byId, el } = Omni;
  const HISTORY_ITEM = "omni-history";
  const HISTORY_MAX = 50;
  const FINAL = new Set(["completed", "failed", "cancelled"]);
  // What the page offers per kind; a model whose audio is speech (task text2speech) is "speech".
  const TASKS = { image: "text2image", video: "text2video", audio: "text2audio", speech: "text2speech" };
  const models = new Map(); // id -> its kind
  let current = null; // { id, abort: AbortController }
  let results = []; // object URLs of the shown result, revoked when replaced

  // ------------------------------------------------------------------ models and params

  function kindOf(kinds, tasks) {
    for (const k of ["video", "image", "audio"]) {
      if (kinds.includes(k)) return k === "audio" && tasks.includes("text2speech") ? "speech" : k;
    }
    return kinds[0] || "image";
  }

  async function loadModels() {
    const r = await api("/v1/models");
    if (!r.ok) throw new Error(await errorText(r));
    const body = await r.json();
    const select = byId("model");
    select.replaceChildren();
    models.clear();
    for (const card of body.data || []) {
      const kind = kindOf(Array.isArray(card.kinds) ? card.kinds : [], Array.isArray(card.tasks) ? card.tasks : []);
      models.set(card.id, kind);
      const option = el("option", card.id + " (" + kind + ")");
      option.value = card.id;
      select.append(option);
    }
    showParams();
  }

  function showParams() {
    const kind = models.get(byId("model").value) || "image";
    byId("kind").textContent = kind;
    for (const label of document.querySelectorAll("[data-kinds]")) {
      label.hidden = !label.dataset.kinds.split(" ").includes(kind);
    }
  }

  function numberOf(id) {
    const input = byId(id);
    if (input.closest("label").hidden || input.value === "") return undefined;
    return Number(input.value);
  }

  function request() {
    const model = byId("model").value;
    const kind = models.get(model) || "image";
    const inputs = { prompt: byId("prompt").value };
    const negative = byId("negative").value;
    if (negative && !byId("negative").closest("label").hidden) inputs.negative_prompt = negative;
    const voice = byId("voice").value.trim();
    if (voice && !byId("voice").closest("label").hidden) inputs.voice = voice;
    const fields = {
      width: "width", height: "height", num_inference_steps: "steps", guidance_scale: "guidance",
      seed: "seed", num_frames: "frames", fps: "fps", speed: "speed", seconds: "seconds",
    };
    for (const [field, id] of Object.entries(fields)) {
      const value = numberOf(id);
      if (value !== undefined) inputs[field] = value;
    }
    if ((inputs.width === undefined) !== (inputs.height === undefined)) {
      delete inputs.width;
      delete inputs.height;
    }
    return { kind, body: { task: TASKS[kind] || "text2image", model, inputs } };
  }

  // ------------------------------------------------------------------ history

  function history() {
    try {
      const items = JSON.parse(localStorage.getItem(HISTORY_ITEM) || "[]");
      return Array.isArray(items) ? items : [];
    } catch (e) {
      return [];
    }
  }

  function saveHistory(items) {
    localStorage.setItem(HISTORY_ITEM, JSON.stringify(items.slice(0, HISTORY_MAX)));
    renderHistory();
  }

  function remember(id, fields) {
    const items = history();
    const found = items.find((item) => item.id === id);
    if (found) Object.assign(found, fields);
    else items.unshift(Object.assign({ id }, fields));
    saveHistory(items);
  }

  function renderHistory() {
    const list = byId("history");
    list.replaceChildren();
    for (const item of history()) {
      const li = el("li");
      li.dataset.job = String(item.id);
      const prompt = el("span", item.prompt, "prompt");
      const meta = el("span", item.model + " · " + new Date(item.at * 1000).toLocaleTimeString(), "muted");
      const status = el("span", item.status, "badge status-" + String(item.status).replace(/[^a-z]/g, ""));
      const show = el("button", "Show");
      show.type = "button";
      show.addEventListener("click", () => reopen(String(item.id)));
      li.append(prompt, el("br"), status, " ", meta, " ", show);
      list.append(li);
    }
  }

  async function reopen(id) {
    setError("");
    try {
      const r = await api("/v1/jobs/" + encodeURIComponent(id));
      if (!r.ok) throw new Error(await errorText(r));
      const job = await r.json();
      remember(id, { status: job.status });
      byId("job-id").textContent = id;
      setStatus(job.status);
      if (job.status === "completed") await showResult(job.result);
      else if (job.status === "running" || job.status === "queued") follow(id);
      else if (job.error) setError(job.error.message);
    } catch (e) {
      if (!(e instanceof Omni.NeedKey)) setError(e.message);
    }
  }

  // ------------------------------------------------------------------ a job

  function setError(text) {
    byId("error").textContent = text || "";
  }

  function setStatus(status) {
    const badge = byId("status");
    badge.textContent = status;
    badge.className = "badge status-" + String(status).replace(/[^a-z]/g, "");
    const busy = status === "queued" || status === "running";
    byId("cancel").disabled = !busy;
    byId("submit").disabled = busy;
  }

  function setProgress(step, steps) {
    const bar = byId("progress");
    bar.max = steps;
    bar.value = step;
    // Every value the bar took, for whoever wants to see that it moved.
    bar.dataset.seen = (bar.dataset.seen ? bar.dataset.seen + "," : "") + step + "/" + steps;
    byId("progress-text").textContent = "step " + step + " / " + steps;
  }

  function parseFrame(frame) {
    const event = { id: null, type: "message", data: "" };
    const data = [];
    for (const line of frame.split("\n")) {
      if (line === "" || line.startsWith(":")) continue;
      const colon = line.indexOf(":");
      const field = colon < 0 ? line : line.slice(0, colon);
      let value = colon < 0 ? "" : line.slice(colon + 1);
      if (value.startsWith(" ")) value = value.slice(1);
      if (field === "id") event.id = value;
      else if (field === "event") event.type = value;
      else if (field === "data") data.push(value);
    }
    if (!data.length) return null;
    try {
      event.data = JSON.parse(data.join("\n"));
    } catch (e) {
      return null;
    }
    return event;
  }

  // The job's events until its final one, resuming after the last id should the stream break.
  async function readEvents(id, signal, onEvent) {
    let last = null;
    for (let attempt = 0; attempt < 10; attempt++) {
      const headers = last ? { "Last-Event-ID": last } : {};
      const r = await api("/v1/jobs/" + encodeURIComponent(id) + "/events", { headers, signal });
      if (!r.ok) throw new Error(await errorText(r));
      const reader = r.body.pipeThrough(new TextDecoderStream()).getReader();
      let buffer = "";
      for (;;) {
        const { value, done } = await reader.read();
        if (done) break;
        buffer = (buffer + value).replace(/\r\n?/g, "\n");
        let end;
        while ((end = buffer.indexOf("\n\n")) >= 0) {
          const event = parseFrame(buffer.slice(0, end));
          buffer = buffer.slice(end + 2);
          if (event === null) continue;
          if (event.id !== null) last = event.id;
          if (event.type === "error") throw new Error(event.data.error ? event.data.error.message : "stream error");
          await onEvent(event);
          if (FINAL.has(event.type)) return;
        }
      }
      await new Promise((resolve) => setTimeout(resolve, 500));
    }
  }

  async function follow(id) {
    if (current) current.abort.abort();
    const abort = new AbortController();
    current = { id, abort };
    try {
      await readEvents(id, abort.signal, async (event) => {
        const d = event.data;
        if (event.type === "queued") setStatus("queued");
        else if (event.type === "started") setStatus("running");
        else if (event.type === "step") setProgress(d.step, d.steps);
        else if (FINAL.has(event.type)) {
          setStatus(event.type);
          remember(id, { status: event.type });
          if (event.type === "completed") {
            const bar = byId("progress");
            setProgress(Number(bar.max), Number(bar.max));
            await showResult(d.result);
          } else if (event.type === "failed") {
            setError(d.error && d.error.message ? d.error.message : "the job failed");
          }
        }
      });
    } catch (e) {
      if (e.name !== "AbortError" && !(e instanceof Omni.NeedKey)) setError(e.message);
    } finally {
      if (current && current.id === id) current = null;
    }
  }

  async function submit(event) {
    event.preventDefault();
    setError("");
    const { kind, body } = request();
    byId("result").replaceChildren();
    const bar = byId("progress");
    bar.max = body.inputs.num_inference_steps || 1;
    bar.value = 0;
    delete bar.dataset.seen;
    byId("progress-text").textContent = "";
    setStatus("submitting");
    try {
      const r = await api("/v1/generate", {
        method: "POST",
        headers: { "Content-Type": "application/json" },
        body: JSON.stringify(body),
      });
      if (!r.ok) throw new Error(await errorText(r));
      const job = await r.json();
      byId("job-id").textContent = job.job_id;
      remember(job.job_id, { prompt: body.inputs.prompt, model: body.model, kind, status: job.status, at: Date.now() / 1000 });
      setStatus(job.status);
      await follow(job.job_id);
    } catch (e) {
      setStatus("error");
      byId("submit").disabled = false;
      if (!(e instanceof Omni.NeedKey)) setError(e.message);
    }
  }

  async function cancel() {
    const id = byId("job-id").textContent;
    if (!id) return;
    byId("cancel").disabled = true;
    try {
      const r = await api("/v1/jobs/" + encodeURIComponent(id), { method: "DELETE" });
      if (!r.ok) throw new Error(await errorText(r));
      const job = await r.json();
      setStatus(job.status);
      remember(id, { status: job.status });
    } catch (e) {
      if (!(e instanceof Omni.NeedKey)) setError(e.message);
    }
  }

  // ------------------------------------------------------------------ the result

  function b64Blob(b64, type) {
    const bytes = Uint8Array.from(atob(b64), (c) => c.charCodeAt(0));
    return new Blob([bytes], { type });
  }

  async function showResult(result) {
    const box = byId("result");
    for (const url of results) URL.revokeObjectURL(url);
    results = [];
    box.replaceChildren();
    if (!result) return;
    const items = [];
    for (const field of ["images", "videos", "audios", "audio"]) {
      const value = result[field];
      if (Array.isArray(value)) items.push(...value);
      else if (value && typeof value === "object") items.push(value);
    }
    for (const item of items) {
      let blob;
      if (typeof item.url === "string") {
        // The file is served by this server: fetched by path, with the key, as a blob.
        const url = new URL(item.url, location.href);
        const r = await api(url.pathname + url.search);
        if (!r.ok) throw new Error(await errorText(r));
        blob = await r.blob();
      } else if (typeof item.b64_json === "string") {
        blob = b64Blob(item.b64_json, "image/" + (result.output_format || "png"));
      } else {
        continue;
      }
      const src = URL.createObjectURL(blob);
      results.push(src);
      let media;
      if (blob.type.startsWith("video/")) {
        media = el("video");
        Object.assign(media, { controls: true, loop: true, muted: true, autoplay: true });
      } else if (blob.type.startsWith("audio/")) {
        media = el("audio");
        media.controls = true;
      } else {
        media = el("img");
        media.alt = "generated image";
      }
      media.src = src;
      const figure = el("figure");
      const caption = el("figcaption", item.seed !== undefined ? "seed " + item.seed : "", "muted");
      figure.append(media, caption);
      box.append(figure);
    }
  }

  // ------------------------------------------------------------------ start

  async function start() {
    setError("");
    renderHistory();
    try {
      await loadModels();
    } catch (e) {
      if (!(e instanceof Omni.NeedKey)) setError(e.message);
    }
  }

  byId("model").addEventListener("change", showParams);
  byId("gen-form").addEventListener("submit", submit);
  byId("cancel").addEventListener("click", cancel);
  byId("clear-history").addEventListener("click", () => saveHistory([]));
  Omni.start(start);
})();
