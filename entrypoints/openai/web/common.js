// Shared by the playground and the dashboard: the API key and calls to the API.
// The key is kept in this tab's sessionStorage and sent as an Authorization header, never in a URL.
// Text from the server or from users is always set with textContent, never parsed as HTML.
"use strict";

const Omni = (() => {
  const KEY_ITEM = "omni-api-key";
  let onKey = null;

  function key() {
    return sessionStorage.getItem(KEY_ITEM) || "";
  }

  function headers(extra) {
    const h = Object.assign({}, extra || {});
    const k = key();
    if (k) h.Authorization = "Bearer " + k;
    return h;
  }

  class NeedKey extends Error {}

  // fetch() with the key; a 401 shows the key form and throws NeedKey.
  async function api(path, options) {
    const opts = Object.assign({}, options || {});
    opts.headers = headers(opts.headers);
    opts.cache = "no-store";
    const r = await fetch(path, opts);
    if (r.status === 401) {
      askKey(key() ? "That key was refused: enter the server's API key." : "This server needs its API key.");
      throw new NeedKey("the API key is needed");
    }
    return r;
  }

  // The message of an OpenAI-shaped error answer.
  async function errorText(r) {
    try {
      const body = await r.json();
      if (body && body.error && body.error.message) return String(body.error.message);
    } catch (e) {
      /* not JSON */
    }
    return "HTTP " + r.status;
  }

  function byId(id) {
    return document.getElementById(id);
  }

  function el(tag, text, className) {
    const node = document.createElement(tag);
    if (text !== undefined && text !== null) node.textContent = String(text);
    if (className) node.className = className;
    return node;
  }

  function askKey(message) {
    const form = byId("key-form");
    byId("key-message").textContent = message;
    form.hidden = false;
    byId("key-input").focus();
  }

  // The page's start function, run at load and again once a key is entered.
  function start(fn) {
    onKey = fn;
    byId("key-form").addEventListener("submit", (event) => {
      event.preventDefault();
      const input = byId("key-input");
      sessionStorage.setItem(KEY_ITEM, input.value.trim());
      input.value = "";
      byId("key-form").hidden = true;
      onKey();
    });
    byId("key-forget").addEventListener("click", () => {
      sessionStorage.removeItem(KEY_ITEM);
      askKey("The key was forgotten.");
    });
    fn();
  }

  return { api, errorText, byId, el, start, NeedKey, headers, key };
})();
