// The chat page: conversations kept in this browser, sent to this server's /v1/chat/completions
// as streams, rendered as they arrive. It talks to no other place.

import { applyChunk, chatEvents } from "./chat_stream.js";
import { escapeHtml, renderMarkdown } from "./markdown.js";
import * as storage from "./storage.js";

const $ = (id) => document.getElementById(id);
// Larger images are scaled down before they are kept, so conversations fit the browser's storage.
const IMAGE_MAX_SIDE = 1536;
const IMAGE_MAX_BYTES = 1.5 * 1024 * 1024;
const DEFAULT_SETTINGS = { thinking: null, temperature: "", maxTokens: "", system: "", tools: "" };

const state = {
  model: null, // the served model's card from GET /v1/models
  key: storage.load("apiKey", ""),
  settings: { ...DEFAULT_SETTINGS, ...storage.load("settings", {}) },
  conversations: storage.load("conversations", []),
  currentId: storage.load("current", null),
  attachments: [], // data URLs of the images going with the next message
  controller: null, // aborts the generation in flight
};

// ---- server -------------------------------------------------------------------------------

function authHeaders() {
  return state.key ? { authorization: `Bearer ${state.key}` } : {};
}

function capabilities() {
  return state.model?.capabilities ?? {};
}

async function errorMessage(response) {
  try {
    const body = await response.json();
    return body.error?.message ?? `HTTP ${response.status}`;
  } catch {
    return `HTTP ${response.status}`;
  }
}

async function connect() {
  setStatus("Connecting…");
  let response;
  try {
    response = await fetch("/v1/models", { headers: authHeaders() });
  } catch {
    setStatus("The server cannot be reached", "error");
    return;
  }
  if (response.status === 401) {
    setStatus("API key needed", "error");
    askForKey(state.key ? "The server refused this key." : "");
    return;
  }
  if (!response.ok) {
    setStatus(await errorMessage(response), "error");
    return;
  }
  state.model = (await response.json()).data[0];
  $("model-name").textContent = state.model.id;
  document.title = `${state.model.id} · NInfer`;
  setStatus("");
  applyCapabilities();
  $("input").focus();
}

function applyCapabilities() {
  const caps = capabilities();
  $("attach").hidden = !caps.vision;
  $("tools-field").hidden = !caps.tools;
  $("forget-key").hidden = !state.key;
}

function requestBody(conversation) {
  const caps = capabilities();
  const settings = state.settings;
  const body = {
    model: state.model.id,
    messages: apiMessages(conversation),
    stream: true,
    stream_options: { include_usage: true },
    timings_per_token: true, // running decode speed while the answer streams
  };
  if (caps.thinking_switch && settings.thinking !== null) body.enable_thinking = settings.thinking;
  const temperature = numberSetting(settings.temperature);
  const maxTokens = numberSetting(settings.maxTokens);
  if (temperature !== null) body.temperature = temperature;
  if (maxTokens !== null) body.max_tokens = maxTokens;
  const tools = caps.tools ? parseTools(settings.tools) : [];
  if (tools.length) body.tools = tools;
  return body;
}

// An empty field means the server's default: null, never 0.
function numberSetting(value) {
  if (value === "" || value === null || value === undefined) return null;
  const number = Number(value);
  return Number.isFinite(number) ? number : null;
}

function apiMessages(conversation) {
  const messages = state.settings.system ? [{ role: "system", content: state.settings.system }] : [];
  for (const message of conversation.messages) {
    if (message.role === "user") {
      const images = message.images ?? [];
      messages.push({
        role: "user",
        content: images.length
          ? [{ type: "text", text: message.content }, ...images.map((url) => ({ type: "image_url", image_url: { url } }))]
          : message.content,
      });
    } else if (message.role === "tool") {
      messages.push({ role: "tool", tool_call_id: message.tool_call_id, content: message.content });
    } else if (message.content || message.tool_calls?.length) {
      // Sent back as generated (reasoning included), so the server renders the same prompt and reuses it.
      const reply = { role: "assistant", content: message.content || null };
      if (message.reasoning) reply.reasoning_content = message.reasoning;
      if (message.tool_calls?.length) reply.tool_calls = message.tool_calls;
      messages.push(reply);
    }
  }
  return messages;
}

function parseTools(text) {
  if (!text.trim()) return [];
  const tools = JSON.parse(text);
  if (!Array.isArray(tools)) throw new Error("Tools must be a JSON array.");
  return tools;
}

// ---- conversations ------------------------------------------------------------------------

function current() {
  return state.conversations.find((conversation) => conversation.id === state.currentId) ?? null;
}

function persist() {
  const saved = storage.save("conversations", state.conversations) && storage.save("current", state.currentId);
  if (!saved) toast("The browser's storage is full: export and delete old conversations to keep new ones.");
}

function openConversation(id) {
  if (state.controller) return;
  state.currentId = id;
  storage.save("current", id);
  state.attachments = [];
  renderAttachments();
  renderConversationList();
  renderConversation();
  closeSidebar();
  $("input").focus();
}

function deleteConversation(id) {
  const conversation = state.conversations.find((c) => c.id === id);
  if (!conversation || !confirm(`Delete "${conversation.title}"?`)) return;
  state.conversations = state.conversations.filter((c) => c.id !== id);
  if (state.currentId === id) state.currentId = null;
  persist();
  renderConversationList();
  renderConversation();
}

// A tool call of the last answer that has no result yet: the next message is its result.
function pendingToolCall(conversation) {
  if (!conversation) return null;
  let i = conversation.messages.length - 1;
  const answered = new Set();
  for (; i >= 0 && conversation.messages[i].role === "tool"; i--) answered.add(conversation.messages[i].tool_call_id);
  const last = conversation.messages[i];
  if (!last || last.role !== "assistant" || last.streaming) return null;
  return (last.tool_calls ?? []).find((call) => !answered.has(call.id)) ?? null;
}

// crypto.randomUUID exists only in secure contexts, and a page on a LAN address is not one.
function newId() {
  return `${Date.now().toString(36)}-${Math.random().toString(36).slice(2, 10)}`;
}

function exportConversations() {
  const data = { format: "ninfer-conversations", version: 1, exported_at: new Date().toISOString(),
                 conversations: state.conversations };
  const url = URL.createObjectURL(new Blob([JSON.stringify(data, null, 2)], { type: "application/json" }));
  const link = document.createElement("a");
  link.href = url;
  link.download = `ninfer-conversations-${new Date().toISOString().slice(0, 19).replace(/[:T]/g, "-")}.json`;
  document.body.append(link);
  link.click();
  link.remove();
  setTimeout(() => URL.revokeObjectURL(url), 10_000);
}

// ---- sending and streaming ----------------------------------------------------------------

async function send() {
  if (state.controller) return;
  if (!state.model) {
    await connect(); // typed before the page finished connecting
    if (!state.model) return;
  }
  const text = $("input").value.trim();
  let conversation = current();
  const pending = pendingToolCall(conversation);
  if (!text && (pending || !state.attachments.length)) return;
  try {
    parseTools(capabilities().tools ? state.settings.tools : "");
  } catch (error) {
    toast(`Settings: the tools are not valid JSON (${error.message}).`);
    return;
  }
  if (!conversation) {
    conversation = { id: newId(), title: "", created: Date.now(), messages: [] };
    state.conversations.unshift(conversation);
    state.currentId = conversation.id;
  }
  if (pending) {
    conversation.messages.push({ role: "tool", tool_call_id: pending.id, name: pending.function.name, content: text });
  } else {
    conversation.messages.push({ role: "user", content: text, images: state.attachments });
    state.attachments = [];
    renderAttachments();
  }
  conversation.title ||= text.slice(0, 80) || "Image";
  conversation.updated = Date.now();
  $("input").value = "";
  resizeInput();
  persist();
  renderConversationList();
  renderConversation();
  if (!pendingToolCall(conversation)) await generate(conversation);
  else renderComposer();
}

async function generate(conversation) {
  const body = requestBody(conversation);
  const message = { role: "assistant", content: "", reasoning: "", tool_calls: [], streaming: true };
  conversation.messages.push(message);
  const element = appendMessage(message, conversation.messages.length - 1);
  const controller = new AbortController();
  state.controller = controller;
  renderComposer();
  try {
    const response = await fetch("/v1/chat/completions", {
      method: "POST",
      headers: { ...authHeaders(), "content-type": "application/json" },
      body: JSON.stringify(body),
      signal: controller.signal,
    });
    if (!response.ok) {
      message.error = await errorMessage(response);
      if (response.status === 401) askForKey("The server refused this key.");
    } else {
      for await (const chunk of chatEvents(response)) {
        if (chunk.error) {
          message.error = chunk.error.message ?? "the generation failed";
          break;
        }
        applyChunk(message, chunk);
        scheduleRender(message, element);
      }
    }
  } catch (error) {
    // Stop aborts the fetch: the connection closes and the server cancels the request.
    if (error.name === "AbortError") message.stopped = true;
    else message.error = error.message || String(error);
  } finally {
    delete message.streaming;
    state.controller = null;
    conversation.updated = Date.now();
    persist();
    renderMessage(message, element);
    renderComposer();
    $("input").focus();
  }
}

function stop() {
  state.controller?.abort();
}

let renderQueued = null;

function scheduleRender(message, element) {
  if (renderQueued) return;
  renderQueued = requestAnimationFrame(() => {
    renderQueued = null;
    renderMessage(message, element);
  });
}

// ---- images -------------------------------------------------------------------------------

async function addImages(files) {
  const images = [...files].filter((file) => file.type.startsWith("image/"));
  if (!images.length) return;
  if (!capabilities().vision) {
    toast("This server takes no images (it runs without --vision).");
    return;
  }
  for (const file of images) {
    try {
      state.attachments.push(await imageDataUrl(file));
    } catch {
      toast(`${file.name || "The image"} could not be read.`);
    }
  }
  renderAttachments();
}

async function imageDataUrl(file) {
  const bitmap = await createImageBitmap(file);
  const scale = Math.min(1, IMAGE_MAX_SIDE / Math.max(bitmap.width, bitmap.height));
  if (scale === 1 && file.size <= IMAGE_MAX_BYTES) {
    bitmap.close();
    return readAsDataUrl(file);
  }
  const canvas = document.createElement("canvas");
  canvas.width = Math.round(bitmap.width * scale);
  canvas.height = Math.round(bitmap.height * scale);
  canvas.getContext("2d").drawImage(bitmap, 0, 0, canvas.width, canvas.height);
  bitmap.close();
  return canvas.toDataURL("image/jpeg", 0.9);
}

function readAsDataUrl(file) {
  return new Promise((resolve, reject) => {
    const reader = new FileReader();
    reader.onload = () => resolve(reader.result);
    reader.onerror = () => reject(reader.error);
    reader.readAsDataURL(file);
  });
}

function renderAttachments() {
  const box = $("attachments");
  box.replaceChildren(...state.attachments.map((url, i) => {
    const item = document.createElement("div");
    item.className = "attachment";
    const image = document.createElement("img");
    image.src = url;
    image.alt = `Image ${i + 1}`;
    const remove = document.createElement("button");
    remove.type = "button";
    remove.className = "remove";
    remove.textContent = "×";
    remove.setAttribute("aria-label", `Remove image ${i + 1}`);
    remove.addEventListener("click", () => {
      state.attachments.splice(i, 1);
      renderAttachments();
    });
    item.append(image, remove);
    return item;
  }));
}

// ---- rendering ----------------------------------------------------------------------------

function renderConversationList() {
  const list = $("conversation-list");
  list.replaceChildren(...state.conversations.map((conversation) => {
    const item = document.createElement("li");
    if (conversation.id === state.currentId) item.className = "current";
    const open = document.createElement("button");
    open.type = "button";
    open.className = "open";
    open.textContent = conversation.title || "New chat";
    open.title = conversation.title;
    if (conversation.id === state.currentId) open.setAttribute("aria-current", "true");
    open.addEventListener("click", () => openConversation(conversation.id));
    const remove = document.createElement("button");
    remove.type = "button";
    remove.className = "delete";
    remove.textContent = "×";
    remove.setAttribute("aria-label", `Delete "${conversation.title}"`);
    remove.addEventListener("click", () => deleteConversation(conversation.id));
    item.append(open, remove);
    return item;
  }));
}

function renderConversation() {
  const box = $("messages");
  const conversation = current();
  box.querySelectorAll(".message").forEach((element) => element.remove());
  $("empty").hidden = Boolean(conversation?.messages.length);
  (conversation?.messages ?? []).forEach((message, i) => appendMessage(message, i));
  renderComposer();
  box.scrollTop = box.scrollHeight;
}

function appendMessage(message, index) {
  const element = document.createElement("article");
  element.className = `message ${message.role}`;
  element.dataset.index = index;
  $("empty").hidden = true;
  $("messages").append(element);
  renderMessage(message, element);
  return element;
}

function renderMessage(message, element) {
  const box = $("messages");
  const atBottom = box.scrollHeight - box.scrollTop - box.clientHeight < 80;
  if (message.role === "user") renderUser(message, element);
  else if (message.role === "tool") renderToolResult(message, element);
  else renderAssistant(message, element);
  if (atBottom) box.scrollTop = box.scrollHeight;
}

function part(element, className, tag = "div") {
  let child = element.querySelector(`:scope > .${className.split(" ")[0]}`);
  if (!child) {
    child = document.createElement(tag);
    child.className = className;
    element.append(child);
  }
  return child;
}

function renderUser(message, element) {
  part(element, "role").textContent = "You";
  part(element, "text").textContent = message.content;
  if (message.images?.length) {
    part(element, "images").replaceChildren(...message.images.map((url, i) => {
      const image = document.createElement("img");
      image.src = url;
      image.alt = `Image ${i + 1}`;
      return image;
    }));
  }
}

function renderToolResult(message, element) {
  part(element, "role").textContent = `Tool result · ${message.name}`;
  part(element, "text", "pre").textContent = message.content;
}

function assistantSkeleton(element) {
  // Built once, in reading order; parts stay hidden until the stream fills them.
  part(element, "role");
  const details = part(element, "reasoning", "details");
  details.hidden = true;
  details.append(document.createElement("summary"), document.createElement("div"));
  details.lastChild.className = "reasoning-body markdown";
  details.firstChild.addEventListener("click", () => { details.dataset.touched = "1"; });
  part(element, "content markdown");
  part(element, "tool-calls").hidden = true;
  part(element, "meta");
}

function renderAssistant(message, element) {
  if (!element.firstChild) assistantSkeleton(element);
  element.dataset.state = message.streaming ? "streaming" : message.error ? "error" : message.stopped ? "stopped" : "done";
  element.setAttribute("aria-busy", message.streaming ? "true" : "false");
  part(element, "role").textContent = state.model?.id ?? "Assistant";
  const details = part(element, "reasoning");
  details.hidden = !message.reasoning;
  if (message.reasoning) {
    const thinking = message.streaming && !message.content && !message.tool_calls.length;
    details.firstChild.textContent = thinking ? "Thinking…" : "Reasoning";
    // Open while the model thinks, folded once the answer starts, unless the user chose.
    if (!details.dataset.touched) details.open = thinking;
    details.lastChild.innerHTML = renderMarkdown(message.reasoning);
  }
  part(element, "content").innerHTML = renderMarkdown(message.content);
  const calls = part(element, "tool-calls");
  calls.hidden = !message.tool_calls?.length;
  calls.replaceChildren(...(message.tool_calls ?? []).map(toolCallElement));
  const meta = part(element, "meta");
  meta.replaceChildren();
  if (message.timings) meta.append(timingsElement(message.timings));
  const note = message.error ? `Error: ${message.error}` : message.stopped ? "Stopped"
    : message.finish_reason === "length" ? "Stopped at the output limit" : "";
  if (note) {
    const span = document.createElement("span");
    span.className = message.error ? "note error" : "note";
    span.textContent = note;
    meta.append(span);
  }
}

function toolCallElement(call) {
  const box = document.createElement("div");
  box.className = "tool-call";
  const head = document.createElement("div");
  head.className = "tool-call-head";
  head.innerHTML = `Tool call <code>${escapeHtml(call.function.name)}</code>`;
  const args = document.createElement("pre");
  try {
    args.textContent = JSON.stringify(JSON.parse(call.function.arguments), null, 2);
  } catch {
    args.textContent = call.function.arguments; // still streaming
  }
  box.append(head, args);
  return box;
}

function rate(value) {
  return value >= 100 ? Math.round(value).toLocaleString("en-US") : value.toFixed(1);
}

function timingsElement(t) {
  const line = document.createElement("span");
  line.className = "timings";
  const items = [
    ["Prompt", `${t.prompt_n} tok${t.prompt_per_second ? `, ${rate(t.prompt_per_second)} tok/s` : ""}`],
    ["Cached", `${t.cache_n} tok`],
    ["Decode", `${t.predicted_n} tok${t.predicted_per_second ? `, ${rate(t.predicted_per_second)} tok/s` : ""}`],
  ];
  if (t.draft_n) items.push(["Drafts", `${t.draft_n_accepted}/${t.draft_n} accepted`]);
  for (const [label, value] of items) {
    const item = document.createElement("span");
    item.dataset.timing = label.toLowerCase();
    const name = document.createElement("b");
    name.textContent = label;
    item.append(name, ` ${value}`);
    line.append(item);
  }
  return line;
}

function renderComposer() {
  const busy = Boolean(state.controller);
  $("send").hidden = busy;
  $("stop").hidden = !busy;
  const pending = pendingToolCall(current());
  const hint = $("pending-tool");
  hint.hidden = !pending;
  if (pending) hint.textContent = `Your next message is the result of the tool call ${pending.function.name}.`;
  $("input").placeholder = pending ? `Result of ${pending.function.name}` : "Message";
}

function resizeInput() {
  const input = $("input");
  input.style.height = "auto";
  input.style.height = `${Math.min(input.scrollHeight, 240)}px`;
}

let toastTimer = null;

function toast(text) {
  const box = $("toast");
  box.textContent = text;
  box.hidden = false;
  clearTimeout(toastTimer);
  toastTimer = setTimeout(() => { box.hidden = true; }, 6000);
}

function setStatus(text, kind = "") {
  const status = $("status");
  status.textContent = text;
  status.className = `status ${kind}`;
}

// ---- dialogs ------------------------------------------------------------------------------

function askForKey(error) {
  const dialog = $("key-dialog");
  $("key-error").textContent = error;
  $("key-input").value = "";
  if (!dialog.open) dialog.showModal();
  $("key-input").focus();
}

function openSettings() {
  const caps = capabilities();
  const settings = state.settings;
  const thinking = $("set-thinking");
  thinking.disabled = !caps.thinking_switch;
  thinking.checked = caps.thinking_switch && settings.thinking !== null ? settings.thinking : Boolean(caps.thinking_default);
  $("thinking-hint").textContent = caps.thinking_switch ? ""
    : `The model's chat template has no thinking switch: thinking is ${caps.thinking_default ? "always on" : "off"}.`;
  $("set-temperature").value = settings.temperature;
  $("set-max-tokens").value = settings.maxTokens;
  $("set-system").value = settings.system;
  $("set-tools").value = settings.tools;
  $("settings-error").textContent = "";
  applyCapabilities();
  $("settings-dialog").showModal();
}

function saveSettings() {
  const caps = capabilities();
  const tools = $("set-tools").value;
  try {
    parseTools(tools);
  } catch (error) {
    $("settings-error").textContent = `Tools: ${error.message}`;
    return;
  }
  const thinking = $("set-thinking").checked;
  state.settings = {
    thinking: caps.thinking_switch && thinking !== Boolean(caps.thinking_default) ? thinking : null,
    temperature: $("set-temperature").value,
    maxTokens: $("set-max-tokens").value,
    system: $("set-system").value,
    tools,
  };
  storage.save("settings", state.settings);
  $("settings-dialog").close();
}

// ---- sidebar (narrow windows) -------------------------------------------------------------

function toggleSidebar(open) {
  document.body.classList.toggle("sidebar-open", open);
  $("toggle-sidebar").setAttribute("aria-expanded", String(open));
  $("backdrop").hidden = !open;
  if (open) $("new-chat").focus();
}

function closeSidebar() {
  if (document.body.classList.contains("sidebar-open")) toggleSidebar(false);
}

// ---- wiring -------------------------------------------------------------------------------

function bind() {
  $("composer").addEventListener("submit", (event) => {
    event.preventDefault();
    send();
  });
  $("input").addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
      event.preventDefault();
      send();
    }
  });
  $("input").addEventListener("input", resizeInput);
  $("input").addEventListener("paste", (event) => {
    if (event.clipboardData?.files.length) {
      event.preventDefault();
      addImages(event.clipboardData.files);
    }
  });
  $("composer").addEventListener("dragover", (event) => event.preventDefault());
  $("composer").addEventListener("drop", (event) => {
    event.preventDefault();
    addImages(event.dataTransfer.files);
  });
  $("attach").addEventListener("click", () => $("file-input").click());
  $("file-input").addEventListener("change", (event) => {
    addImages(event.target.files);
    event.target.value = "";
  });
  $("stop").addEventListener("click", stop);
  $("new-chat").addEventListener("click", () => openConversation(null));
  $("export").addEventListener("click", exportConversations);
  $("open-settings").addEventListener("click", openSettings);
  $("cancel-settings").addEventListener("click", () => $("settings-dialog").close());
  $("settings-form").addEventListener("submit", (event) => {
    event.preventDefault();
    saveSettings();
  });
  $("forget-key").addEventListener("click", () => {
    state.key = "";
    storage.remove("apiKey");
    $("settings-dialog").close();
    state.model = null;
    connect();
  });
  $("key-form").addEventListener("submit", (event) => {
    event.preventDefault();
    state.key = $("key-input").value.trim();
    storage.save("apiKey", state.key);
    $("key-dialog").close();
    connect();
  });
  $("key-dialog").addEventListener("cancel", (event) => event.preventDefault()); // nothing works without it
  $("toggle-sidebar").addEventListener("click", () => toggleSidebar(!document.body.classList.contains("sidebar-open")));
  $("backdrop").addEventListener("click", closeSidebar);
  $("messages").addEventListener("click", (event) => {
    const button = event.target.closest("[data-copy]");
    if (!button) return;
    const code = button.closest(".code-block").querySelector("code");
    const selectIt = () => {
      getSelection().selectAllChildren(code);
      toast("Copying needs HTTPS or localhost here: the code is selected, press Ctrl+C.");
    };
    if (!navigator.clipboard) return selectIt(); // only in secure contexts
    navigator.clipboard.writeText(code.textContent).then(() => {
      button.textContent = "Copied";
      setTimeout(() => { button.textContent = "Copy"; }, 1500);
    }, selectIt);
  });
  document.addEventListener("keydown", (event) => {
    if (event.key === "Escape" && state.controller && !document.querySelector("dialog[open]")) {
      event.preventDefault();
      stop();
    } else if (event.key === "Escape") {
      closeSidebar();
    } else if (event.altKey && !event.ctrlKey && !event.metaKey && event.code === "KeyN") {
      event.preventDefault();
      openConversation(null);
    } else if (event.altKey && !event.ctrlKey && !event.metaKey && event.code === "KeyS") {
      event.preventDefault();
      openSettings();
    }
  });
}

// An answer saved while it streamed (the page was closed then) is an answer that was stopped.
for (const message of state.conversations.flatMap((conversation) => conversation.messages)) {
  if (message.streaming) {
    delete message.streaming;
    message.stopped = true;
  }
}
bind();
renderConversationList();
renderConversation();
connect();
