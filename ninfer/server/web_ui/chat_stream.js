// A streamed chat completion (server-sent events) read into an assistant message, delta by delta.

// The JSON object of each `data:` event; comments (`: keep-alive`) carry none. Ends at [DONE].
export async function* chatEvents(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true }).replace(/\r\n?/g, "\n");
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      const data = event.split("\n").filter((line) => line.startsWith("data:"))
        .map((line) => line.slice(5).trimStart()).join("\n");
      if (data === "[DONE]") return;
      if (data) yield JSON.parse(data);
    }
  }
}

// Folds one chunk into `message` ({content, reasoning, tool_calls, timings, usage, finish_reason}).
// Running timings come with every chunk (timings_per_token); the last chunk's are the final ones.
export function applyChunk(message, chunk) {
  if (chunk.timings) message.timings = chunk.timings;
  if (chunk.usage) message.usage = chunk.usage;
  for (const choice of chunk.choices ?? []) {
    const delta = choice.delta ?? {};
    if (delta.reasoning_content) message.reasoning += delta.reasoning_content;
    if (delta.content) message.content += delta.content;
    for (const call of delta.tool_calls ?? []) {
      message.tool_calls[call.index] ??= { id: "", type: "function", function: { name: "", arguments: "" } };
      const slot = message.tool_calls[call.index];
      if (call.id) slot.id = call.id;
      if (call.function?.name) slot.function.name += call.function.name;
      if (call.function?.arguments) slot.function.arguments += call.function.arguments;
    }
    if (choice.finish_reason) message.finish_reason = choice.finish_reason;
  }
}
