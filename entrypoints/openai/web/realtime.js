// The playground's realtime tab: a session over WS /v1/realtime with the microphone as its input.
// The microphone's samples go to the server as pcm16 at the audio context's rate
// (input_audio_buffer.append); the server's turn detection commits each turn when the speaker
// stops and answers it: the transcript as it streams, then the answer's audio, played from a blob.
// The key travels as a WebSocket subprotocol (a browser cannot set the socket's headers), never in
// the URL. Only models whose first stage recognises speech (audio_input on /v1/models) are offered.
"use strict";

(() => {
  const { byId, el, key } = Omni;
  // A frame of microphone audio per message (about 85 ms at 48 kHz).
  const FRAME = 4096;
  // The rate of the answer's audio deltas.
  const OUTPUT_RATE = 24000;
  const VAD = { type: "server_vad", threshold: 0.02, silence_duration_ms: 500 };
  let session = null; // { ws, stream, context, processor }
  let turn = null; // the answer being received: { item, text, pcm: [Uint8Array] }

  function status(text, kind) {
    const badge = byId("rt-status");
    badge.textContent = text;
    badge.className = "badge" + (kind ? " status-" + kind : "");
  }

  function showModels(event) {
    const select = byId("rt-model");
    const was = select.value;
    select.replaceChildren();
    for (const card of event.detail) {
      if (!card.audio_input) continue;
      const option = el("option", card.id);
      option.value = card.id;
      select.append(option);
    }
    if ([...select.options].some((o) => o.value === was)) select.value = was;
    byId("rt-start").disabled = session !== null || !select.options.length;
    if (!select.options.length) status("no model here takes audio in");
  }

  // ------------------------------------------------------------------ audio

  function pcm16(samples) {
    const out = new Int16Array(samples.length);
    for (let i = 0; i < samples.length; i++) {
      const s = Math.max(-1, Math.min(1, samples[i]));
      out[i] = s < 0 ? s * 0x8000 : s * 0x7fff;
    }
    return new Uint8Array(out.buffer);
  }

  function b64(bytes) {
    let text = "";
    for (let i = 0; i < bytes.length; i += 0x8000) text += String.fromCharCode(...bytes.subarray(i, i + 0x8000));
    return btoa(text);
  }

  function unb64(text) {
    const raw = atob(text);
    const bytes = new Uint8Array(raw.length);
    for (let i = 0; i < raw.length; i++) bytes[i] = raw.charCodeAt(i);
    return bytes;
  }

  // pcm16 mono pieces as a WAV blob.
  function wav(pieces, rate) {
    const size = pieces.reduce((n, p) => n + p.length, 0);
    const head = new DataView(new ArrayBuffer(44));
    const text = (at, s) => [...s].forEach((c, i) => head.setUint8(at + i, c.charCodeAt(0)));
    text(0, "RIFF");
    head.setUint32(4, 36 + size, true);
    text(8, "WAVEfmt ");
    head.setUint32(16, 16, true);
    head.setUint16(20, 1, true);
    head.setUint16(22, 1, true);
    head.setUint32(24, rate, true);
    head.setUint32(28, rate * 2, true);
    head.setUint16(32, 2, true);
    head.setUint16(34, 16, true);
    text(36, "data");
    head.setUint32(40, size, true);
    return new Blob([head.buffer, ...pieces], { type: "audio/wav" });
  }

  // ------------------------------------------------------------------ the session

  function send(event) {
    if (session && session.ws.readyState === WebSocket.OPEN) session.ws.send(JSON.stringify(event));
  }

  async function startMicrophone() {
    const stream = await navigator.mediaDevices.getUserMedia({ audio: { channelCount: 1 } });
    const context = new AudioContext();
    await context.resume(); // started by the click on "Start talking"
    const source = context.createMediaStreamSource(stream);
    // A script processor, not a worklet: a worklet's module would be one more script to serve.
    const processor = context.createScriptProcessor(FRAME, 1, 1);
    processor.onaudioprocess = (event) => {
      const samples = event.inputBuffer.getChannelData(0);
      let peak = 0;
      for (const s of samples) peak = Math.max(peak, Math.abs(s));
      byId("rt-level").textContent = "level " + peak.toFixed(2);
      send({ type: "input_audio_buffer.append", audio: b64(pcm16(samples)) });
    };
    source.connect(processor);
    processor.connect(context.destination); // a processor runs only when connected; it writes silence
    Object.assign(session, { stream, context, processor });
    return Math.max(8000, Math.min(48000, Math.round(context.sampleRate)));
  }

  function onEvent(event) {
    const list = byId("rt-turns");
    switch (event.type) {
      case "session.created":
        status("connected", "running");
        startMicrophone()
          .then((rate) => {
            const settings = { input_sample_rate: rate, output_sample_rate: OUTPUT_RATE, turn_detection: VAD };
            send({ type: "session.update", session: settings });
            status("listening", "running");
          })
          .catch((e) => fail("the microphone: " + e.message));
        break;
      case "input_audio_buffer.speech_started":
        status("hearing you", "running");
        break;
      case "input_audio_buffer.speech_stopped":
        status("thinking", "running");
        break;
      case "input_audio_buffer.committed": {
        const item = el("li", "");
        item.dataset.item = event.item_id;
        item.append(el("span", "you spoke (" + event.item_id + ")", "muted heard"));
        list.prepend(item);
        break;
      }
      case "conversation.item.input_audio_transcription.completed":
      case "conversation.item.input_audio_transcription.failed": {
        // What the model heard of a turn (its transcript, the segments joined), once complete.
        const item = [...list.children].find((li) => li.dataset.item === event.item_id);
        if (!item) break;
        const heard = event.transcript !== undefined;
        item.dataset.heard = heard ? "completed" : "failed";
        item.querySelector(".heard").textContent = heard
          ? "you said: " + (event.transcript || "(no words heard)")
          : "not heard: " + event.error.message;
        break;
      }
      case "response.created": {
        const item = list.firstElementChild || el("li", "");
        if (!item.parentNode) list.prepend(item);
        const answer = el("p", "", "answer");
        item.append(answer);
        turn = { item, answer, pcm: [] };
        item.dataset.response = event.response.id;
        break;
      }
      case "response.audio_transcript.delta":
      case "response.text.delta":
        if (turn) turn.answer.textContent += event.delta;
        break;
      case "response.audio.delta":
        if (turn) turn.pcm.push(unb64(event.delta));
        break;
      case "response.done":
        if (turn) {
          const state = event.response.status;
          turn.item.dataset.status = state;
          if (turn.pcm.length) {
            const audio = el("audio");
            audio.controls = true;
            audio.src = URL.createObjectURL(wav(turn.pcm, OUTPUT_RATE));
            turn.item.append(audio);
            audio.play().catch(() => {}); // autoplay may be refused: the controls stay
          }
          turn = null;
          status(state === "completed" ? "listening" : state, state === "completed" ? "running" : state);
        }
        break;
      case "error":
        byId("rt-error").textContent = event.error.message;
        break;
      default:
        break;
    }
  }

  function fail(message) {
    byId("rt-error").textContent = message;
    stop();
    status("stopped", "failed");
  }

  function start() {
    if (session) return;
    byId("rt-error").textContent = "";
    const model = byId("rt-model").value;
    const scheme = location.protocol === "https:" ? "wss://" : "ws://";
    const url = scheme + location.host + "/v1/realtime?model=" + encodeURIComponent(model);
    const protocols = ["realtime"];
    if (key()) protocols.push("openai-insecure-api-key." + key());
    const ws = new WebSocket(url, protocols);
    session = { ws };
    ws.onmessage = (message) => onEvent(JSON.parse(message.data));
    ws.onclose = (event) => {
      if (session && session.ws === ws) {
        if (event.code === 4401) Omni.byId("key-form").hidden = false;
        stop();
        status(event.code === 1000 ? "stopped" : "closed (" + event.code + ")", event.code === 1000 ? "" : "failed");
      }
    };
    byId("rt-start").disabled = true;
    byId("rt-stop").disabled = false;
    status("connecting", "queued");
  }

  function stop() {
    const was = session;
    session = null;
    turn = null;
    if (was) {
      if (was.processor) was.processor.disconnect();
      if (was.stream) was.stream.getTracks().forEach((t) => t.stop());
      if (was.context) was.context.close();
      if (was.ws.readyState <= WebSocket.OPEN) was.ws.close(1000);
    }
    byId("rt-start").disabled = !byId("rt-model").options.length;
    byId("rt-stop").disabled = true;
    byId("rt-level").textContent = "";
  }

  document.addEventListener("omni:models", showModels);
  byId("rt-start").addEventListener("click", start);
  byId("rt-stop").addEventListener("click", () => {
    stop();
    status("stopped");
  });
})();
