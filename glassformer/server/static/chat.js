// glassformer lab, view 1: chat with the loaded model. Streams POST /v1/chat/completions
// (stream: true, read as server-sent events) and, per turn, asks POST /lab/api/turn_cost for the
// KV-cache bytes the conversation holds; the turn's row also shows time to first token, decode
// tokens/s and the prompt tokens the server reused from its cache. Needs common.js.
"use strict";

// messages: what the next request sends. conversation: bumped by "New conversation", so a reply
// still arriving for the old conversation is dropped, never added to the new one. controller:
// the running reply's AbortController; aborting closes the stream, and the server cancels a
// request whose client has gone (its row leaves the batch at the next step).
const chat = { messages: [], turn: 0, conversation: 0, controller: null };

function setChatBusy(busy) {
  $("#chat-send").disabled = busy;
  $("#chat-stop").disabled = !busy;
}

// Read a server-sent-event stream: call onData(json) for each `data:` line until [DONE].
async function readEvents(response, onData) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    const events = buffer.split(/\r?\n\r?\n/);
    buffer = events.pop();
    for (const event of events) {
      for (const line of event.split(/\r?\n/)) {
        if (!line.startsWith("data:")) continue;
        const data = line.slice(5).trim();
        if (data === "[DONE]") return;
        onData(JSON.parse(data));
      }
    }
  }
}

// The reply format chosen under the message: free text, any JSON object, or JSON valid under
// the schema typed in (OpenAI's response_format; the server masks each step's tokens to it).
function responseFormat() {
  const kind = $("#chat-format").value;
  if (kind === "text") return undefined;
  if (kind === "json_object") return { type: "json_object" };
  let schema;
  try {
    schema = JSON.parse($("#chat-schema").value);
  } catch (error) {
    throw new Error(`the JSON Schema is not valid JSON: ${error.message}`);
  }
  return { type: "json_schema", json_schema: { name: "reply", schema, strict: true } };
}

function showSchemaBox() {
  const hidden = $("#chat-format").value !== "json_schema";
  $("#chat-schema").hidden = hidden;
  $("label[for=chat-schema]").hidden = hidden;
}

// One streamed reply: its text (shown as it grows), finish_reason, usage and timing.
async function streamChat(messages, signal, show) {
  const response = await fetch("/v1/chat/completions", {
    method: "POST",
    headers: { "Content-Type": "application/json", ...authHeaders() },
    signal,
    body: JSON.stringify({
      model: state.info.model.name,
      messages,
      stream: true,
      stream_options: { include_usage: true },  // the last chunk carries usage
      temperature: Number($("#chat-temperature").value),
      max_tokens: Number($("#chat-max-tokens").value),
      response_format: responseFormat(),
    }),
  });
  if (!response.ok) {
    const payload = await response.json().catch(() => null);
    askForKey(response.status);
    throw new Error(errorMessage(response.status, payload));
  }
  const reply = { content: "", pieces: 0, firstAt: null, usage: null, finish: null };
  await readEvents(response, (chunk) => {
    if (chunk.error) throw new Error(chunk.error.message);  // a failure mid-stream
    if (chunk.usage) reply.usage = chunk.usage;
    const choice = chunk.choices && chunk.choices[0];
    if (!choice) return;
    if (choice.finish_reason) reply.finish = choice.finish_reason;
    const piece = choice.delta && choice.delta.content;
    if (!piece) return;
    if (reply.firstAt === null) reply.firstAt = performance.now();
    reply.pieces += 1;
    reply.content += piece;
    show(reply.content);
  });
  reply.endedAt = performance.now();
  return reply;
}

function markReply(node, kind, text, title) {
  node.dataset.finish = kind;
  node.append(element("span", { class: `mark ${kind}`, text, title }));
}

async function sendChat(event) {
  event.preventDefault();
  const input = $("#chat-input");
  const text = input.value.trim();
  if (!text || chat.controller) return;  // one reply at a time
  const conversation = chat.conversation;
  const controller = new AbortController();
  chat.controller = controller;
  setChatBusy(true);
  const log = $("#chat-log");
  chat.messages.push({ role: "user", content: text });
  const sent = chat.messages.slice();
  const words = element("span", { class: "text" });
  const node = element("div", { class: "message assistant", "aria-busy": "true" }, words);
  log.append(element("div", { class: "message user", text }), node);
  input.value = "";
  const maxTokens = Number($("#chat-max-tokens").value);
  const started = performance.now();
  try {
    const reply = await streamChat(sent, controller.signal, (content) => {
      words.textContent = content;
      log.scrollTop = log.scrollHeight;
    });
    if (conversation !== chat.conversation) return;
    chat.messages.push({ role: "assistant", content: reply.content });
    node.dataset.done = "true";
    if (reply.finish === "length") {
      markReply(node, "length", `cut at max tokens (${maxTokens})`,
        "finish_reason: length. The reply reached max tokens; raise it for a longer one.");
    } else if ($("#chat-format").value !== "text") {
      markReply(node, "json", "JSON", "The reply was constrained to JSON (response_format).");
    }
    addTurnRow(conversation, sent, reply, started);
  } catch (error) {
    if (conversation !== chat.conversation) return;  // "New conversation" dropped it
    if (error.name !== "AbortError") {
      node.classList.add("error");
      words.textContent = error.message;
      chat.messages.pop();  // the turn did not happen
    } else if (words.textContent) {  // Stop: the part already shown stays in the conversation
      chat.messages.push({ role: "assistant", content: words.textContent });
      markReply(node, "stopped", "stopped", "You stopped this reply; the server stopped it too.");
    } else {
      chat.messages.pop();
      markReply(node, "stopped", "stopped before the first token: not part of the conversation");
    }
  } finally {
    node.setAttribute("aria-busy", "false");
    if (chat.controller === controller) {
      chat.controller = null;
      setChatBusy(false);
    }
  }
}

// The turn's row: time to first token, decode speed, the prompt tokens the server reused from
// its cache (usage.prompt_tokens_details.cached_tokens), and the KV bytes the turn leaves.
async function addTurnRow(conversation, sent, reply, started) {
  const { usage, firstAt, endedAt } = reply;
  const completion = usage ? usage.completion_tokens : reply.pieces;
  let cost;
  try {
    cost = await api("/lab/api/turn_cost", {
      messages: sent,
      completion_tokens: completion,
      prompt_tokens: usage ? usage.prompt_tokens : null,
    });
  } catch (error) {
    showError(error.message);
    return;
  }
  if (conversation !== chat.conversation) return;
  chat.turn += 1;
  const ttft = firstAt === null ? null : (firstAt - started) / 1000;
  // Decode speed: the tokens after the first over the time after the first.
  const rate = firstAt !== null && completion > 1 && endedAt > firstAt
    ? (completion - 1) / ((endedAt - firstAt) / 1000) : null;
  const details = usage && usage.prompt_tokens_details;
  const cached = details && Number.isFinite(details.cached_tokens) ? details.cached_tokens : null;
  const row = element("tr", {
    "data-ttft": ttft ?? "",
    "data-kv-bytes": cost.kv_bytes,
    "data-cached-prompt-tokens": cached ?? "",
  },
  element("td", { text: chat.turn }),
  element("td", { text: ttft === null ? "—" : `${(ttft * 1000).toFixed(0)} ms` }),
  element("td", { text: rate === null ? "—" : rate.toFixed(1) }),
  element("td", { text: `${cost.prompt_tokens} + ${cost.completion_tokens}` }),
  element("td", { text: cached === null ? "—" : `${cached} of ${cost.prompt_tokens}` }),
  element("td", {
    text: `${formatBytes(cost.kv_bytes)} (${cost.cached_tokens} × ${cost.kv_bytes_per_token} B, ${cost.kv_dtype})`,
  }));
  $("#chat-stats tbody").append(row);
}

// Enter sends, Shift+Enter is a new line; Enter that confirms an input method's candidate
// (typing Chinese with pinyin) stays the input method's.
function chatKeys(event) {
  if (event.key !== "Enter" || event.shiftKey || event.isComposing) return;
  event.preventDefault();
  $("#chat-form").requestSubmit();
}

function stopChat() {
  if (chat.controller) chat.controller.abort();
}

function resetChat() {
  chat.conversation += 1;
  stopChat();
  chat.controller = null;
  setChatBusy(false);
  chat.messages = [];
  chat.turn = 0;
  $("#chat-log").replaceChildren();
  $("#chat-stats tbody").replaceChildren();
}

function setUpChat() {
  $("#chat-form").addEventListener("submit", sendChat);
  $("#chat-reset").addEventListener("click", resetChat);
  $("#chat-stop").addEventListener("click", stopChat);
  $("#chat-input").addEventListener("keydown", chatKeys);
  $("#chat-format").addEventListener("change", showSchemaBox);
}
