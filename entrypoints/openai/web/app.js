// The playground: every served model with what it can do (GET /v1/models), and a prompt sent to
// the route of the task chosen: images and audio as jobs (POST /v1/generate), a video as a video
// (POST /v1/videos, itself a job), both followed through the job's events (SSE read with fetch, so
// that the key goes in a header) and cancellable; speech from POST /v1/audio/speech and an answer
// from POST /v1/chat/completions, cancelled by dropping the request. This browser keeps the jobs'
// history.
"use strict";

(() => {
  const { api, errorText, byId, el } = Omni;
  const HISTORY_ITEM = "omni-history";
  const HISTORY_MAX = 50;
  const FINAL = new Set(["completed", "failed", "cancelled"]);
  // The tasks the page runs, in the order it offers them: each task's kind (its parameters, the
  // data-kinds of index.html) and how it is sent (the route: submitters below).
  const TASKS = {
    text2image: { kind: "image", send: "job" },
    text2video: { kind: "video", send: "video" },
    text2audio: { kind: "audio", send: "job" },
    text2speech: { kind: "speech", send: "speech" },
    chat: { kind: "chat", send: "chat" },
  };
  const models = new Map(); // id -> its card from /v1/models
  let current = null; // the job followed: { id, abort: AbortController }
  let direct = null; // the speech or chat request waiting for its answer: an AbortController
  let results = []; // object URLs of the shown result, revoked when replaced

  // ------------------------------------------------------------------ models and params

  // The tasks of a model the page can run, from what it serves (its capabilities).
  function tasksOf(card) {
    const serves = Array.isArray(card.serves) ? card.serves : Array.isArray(card.tasks) ? card.tasks : [];
    return Object.keys(TASKS).filter((task) => serves.includes(task));
  }

  async function loadModels() {
    const r = await api("/v1/models");
    if (!r.ok) throw new Error(await errorText(r));
    const body = await r.json();
    const select = byId("model");
    const was = select.value;
    select.replaceChildren();
    models.clear();
    for (const card of body.data || []) {
      models.set(card.id, card);
      const tasks = tasksOf(card);
      const option = el("option", card.id + " (" + (tasks.length ? TASKS[tasks[0]].kind : "nothing to run here") + ")");
      option.value = card.id;
      option.disabled = !tasks.length;
      select.append(option);
    }
    if (models.has(was)) select.value = was;
    showTasks();
    // The realtime tab (realtime.js) offers the models that answer a session.
    document.dispatchEvent(new CustomEvent("omni:models", { detail: body.data || [] }));
  }

  function showTasks() {
    const card = models.get(byId("model").value);
    const select = byId("task");
    select.replaceChildren();
    if (!card) return showParams();
    for (const task of tasksOf(card)) {
      const option = el("option", task);
      option.value = task;
      select.append(option);
    }
    const what = [
      card.state,
      "makes " + ((card.kinds || []).join(", ") || "–"),
      "serves " + ((card.serves || []).join(", ") || "–"),
    ];
    if (card.voices && card.voices.length) what.push("voices " + card.voices.join(", "));
    byId("caps").textContent = what.join(" · ");
    const voices = byId("voices");
    voices.replaceChildren(...(card.voices || []).map((v) => Object.assign(el("option"), { value: v })));
    showParams();
  }

  function showParams() {
    const task = TASKS[byId("task").value];
    const kind = task ? task.kind : "";
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

  function textOf(id) {
    const input = byId(id);
    const value = input.value.trim();
    return value && !input.closest("label").hidden ? value : undefined;
  }

  // The form's values that apply to the task (the hidden fields are left out), by job field name.
  function inputs() {
    const out = { prompt: byId("prompt").value };
    if (textOf("negative") !== undefined) out.negative_prompt = textOf("negative");
    if (textOf("voice") !== undefined) out.voice = textOf("voice");
    const fields = {
      width: "width", height: "height", num_inference_steps: "steps", guidance_scale: "guidance",
      seed: "seed", num_frames: "frames", fps: "fps", speed: "speed", seconds: "seconds",
    };
    for (const [field, id] of Object.entries(fields)) {
      const value = numberOf(id);
      if (value !== undefined) out[field] = value;
    }
    if ((out.width === undefined) !== (out.height === undefined)) {
      delete out.width;
      delete out.height;
    }
    return out;
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
    const busy = status === "queued" || status === "running" || status === "loading";
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
        else if (event.type === "loading") setStatus("loading");
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

  async function post(path, body, signal) {
    const r = await api(path, {
      method: "POST",
      headers: { "Content-Type": "application/json" },
      body: JSON.stringify(body),
      signal,
    });
    if (!r.ok) throw new Error(await errorText(r));
    return r;
  }

  // A job (POST /v1/generate) or a video (POST /v1/videos): its id, then its events.
  async function submitJob(model, task, values) {
    let job;
    if (TASKS[task].send === "video") {
      const { prompt, negative_prompt, width, height, num_frames, fps, num_inference_steps, guidance_scale, seed } = values;
      const size = width !== undefined ? width + "x" + height : undefined;
      const body = { model, prompt, negative_prompt, size, num_frames, fps, num_inference_steps, guidance_scale, seed };
      const video = await (await post("/v1/videos", body)).json();
      job = { job_id: video.id, status: video.status === "in_progress" ? "running" : video.status };
    } else {
      job = await (await post("/v1/generate", { task, model, inputs: values })).json();
    }
    byId("job-id").textContent = job.job_id;
    remember(job.job_id, { prompt: values.prompt, model, kind: TASKS[task].kind, status: job.status, at: Date.now() / 1000 });
    setStatus(job.status);
    await follow(job.job_id);
  }

  // Speech (POST /v1/audio/speech) or a chat answer (POST /v1/chat/completions): one answer.
  async function submitDirect(model, task, values) {
    direct = new AbortController();
    setStatus("running");
    try {
      if (TASKS[task].send === "speech") {
        const { voice, speed, seed } = values;
        const body = { model, input: values.prompt, voice: voice || "alloy", speed, seed, response_format: "wav" };
        const r = await post("/v1/audio/speech", body, direct.signal);
        await showBlobs([{ blob: await r.blob(), caption: voice || "alloy" }]);
      } else {
        const body = { model, messages: [{ role: "user", content: values.prompt }] };
        const answer = await (await post("/v1/chat/completions", body, direct.signal)).json();
        await showMessage(answer.choices && answer.choices[0] ? answer.choices[0].message : null);
      }
      setStatus("completed");
    } finally {
      direct = null;
    }
  }

  async function submit(event) {
    event.preventDefault();
    setError("");
    const model = byId("model").value;
    const task = byId("task").value;
    if (!TASKS[task]) return setError("this model has no task the playground can run");
    const values = inputs();
    clearResult();
    byId("job-id").textContent = "";
    const bar = byId("progress");
    bar.max = values.num_inference_steps || 1;
    bar.value = 0;
    delete bar.dataset.seen;
    byId("progress-text").textContent = "";
    setStatus("submitting");
    try {
      if (TASKS[task].send === "speech" || TASKS[task].send === "chat") await submitDirect(model, task, values);
      else await submitJob(model, task, values);
    } catch (e) {
      if (e.name === "AbortError") return; // cancelled: the status says so already
      setStatus("error");
      byId("submit").disabled = false;
      if (!(e instanceof Omni.NeedKey)) setError(e.message);
    }
  }

  async function cancel() {
    if (direct) {
      direct.abort(); // the server aborts a request whose client went away
      setStatus("cancelled");
      return;
    }
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

  function clearResult() {
    for (const url of results) URL.revokeObjectURL(url);
    results = [];
    byId("result").replaceChildren();
  }

  // Each blob shown after its media type, with its caption.
  async function showBlobs(items) {
    const box = byId("result");
    for (const { blob, caption } of items) {
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
      figure.append(media, el("figcaption", caption, "muted"));
      box.append(figure);
    }
  }

  // A job's result: its files fetched with the key (or inline base64), as blobs.
  async function showResult(result) {
    clearResult();
    if (!result) return;
    const items = [];
    for (const field of ["images", "videos", "audios", "audio"]) {
      const value = result[field];
      if (Array.isArray(value)) items.push(...value);
      else if (value && typeof value === "object") items.push(value);
    }
    const blobs = [];
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
      blobs.push({ blob, caption: item.seed !== undefined ? "seed " + item.seed : "" });
    }
    await showBlobs(blobs);
  }

  // A chat answer: its text, its images (data URLs) and its spoken audio.
  async function showMessage(message) {
    clearResult();
    if (!message) return;
    const box = byId("result");
    const parts = Array.isArray(message.content) ? message.content : [{ type: "text", text: message.content }];
    const blobs = [];
    for (const part of parts) {
      if (part && part.type === "text" && part.text) box.append(el("p", part.text, "answer"));
      else if (part && part.type === "image_url" && part.image_url) {
        // A data URL, decoded here: the policy lets the page fetch from this origin only.
        const found = /^data:([\w/+.-]+);base64,(.*)$/.exec(String(part.image_url.url));
        if (found) blobs.push({ blob: b64Blob(found[2], found[1]), caption: "" });
      }
    }
    if (message.audio && typeof message.audio.data === "string") {
      blobs.push({ blob: b64Blob(message.audio.data, "audio/wav"), caption: message.audio.transcript || "" });
    }
    await showBlobs(blobs);
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

  byId("model").addEventListener("change", showTasks);
  byId("task").addEventListener("change", showParams);
  byId("gen-form").addEventListener("submit", submit);
  byId("cancel").addEventListener("click", cancel);
  byId("clear-history").addEventListener("click", () => saveHistory([]));
  Omni.start(start);
})();
