// The answers of Orchard's HTTP API (`POST /v1/chat/completions`), built in the browser from
// the WebSocket API's messages, for OrchardClient.fetch (orchard.js): the SSE framing, the
// non-streaming `chat.completion` body and the HTTP status of an error. The gateway's own
// versions are protocol/openai/ (response.py, stream.py, errors.py) and gateway/http_errors.py.

/** @typedef {import("./orchard.js").OpenAIErrorBody} OpenAIErrorBody */
/** @typedef {import("./orchard.js").Usage} Usage */
/** @typedef {import("./orchard.js").ChatCompletionChunk} ChatCompletionChunk */

/** The last event of every SSE response, after an error event too. */
export const SSE_DONE = "data: [DONE]\n\n";

/** The HTTP status of an error, where its code decides it... */
const STATUS_BY_CODE = {
  model_not_found: 404,
  message_too_large: 413,
  request_too_large: 413,
  invalid_api_key: 401,
  origin_not_allowed: 403,
  runner_lost: 502,
  service_unavailable: 503,
  model_unavailable: 503,
  shutting_down: 503,
  timeout: 504,
};
/** ...else where its type does; anything else is a 500. */
const STATUS_BY_TYPE = {
  invalid_request_error: 400,
  authentication_error: 401,
  permission_error: 403,
  rate_limit_error: 429,
};

/** @param {OpenAIErrorBody} error @returns {number} */
export function httpStatus(error) {
  return STATUS_BY_CODE[/** @type {keyof STATUS_BY_CODE} */ (error.code)]
    ?? STATUS_BY_TYPE[/** @type {keyof STATUS_BY_TYPE} */ (error.type)]
    ?? 500;
}

/**
 * The HTTP API's answer to a request that failed: its status and `{"error": {…}}`.
 * @param {OpenAIErrorBody} error @param {Record<string, string>} [headers]
 */
export function errorResponse(error, headers = {}) {
  return new Response(JSON.stringify({ error }), {
    status: httpStatus(error),
    headers: { ...headers, "content-type": "application/json" },
  });
}

/**
 * A 400 answered in the browser, worded as the gateway words it (protocol/openai/request.py).
 * @param {string} message @param {string | null} param @param {string | null} code
 */
export function badRequest(message, param, code) {
  return errorResponse({ message, type: "invalid_request_error", param, code });
}

/**
 * The text of a `chunk` message's chunk object as the gateway wrote it, which is what an SSE
 * `data:` event carries (the gateway renders both alike); re-serialized only if the message
 * is not laid out as the gateway lays it out.
 * @param {string} data the message's text @param {Record<string, any>} message it parsed
 */
export function chunkJson(data, message) {
  const head = `{"type":"chunk","request_id":${JSON.stringify(message.request_id)},"chunk":`;
  return data.startsWith(head) && data.endsWith("}")
    ? data.slice(head.length, -1)
    : JSON.stringify(message.chunk);
}

/**
 * The non-streaming `chat.completion` body, collected from a streamed completion's chunks as
 * the gateway's CompletionBuilder collects them: each choice's text, reasoning and logprobs
 * joined, its tool calls merged by index, its finish reason.
 */
export class CompletionBody {
  /** @param {boolean} logprobs the request asked for logprobs */
  constructor(logprobs) {
    this.logprobs = logprobs;
    /** @type {ChatCompletionChunk | null} */ this.first = null;
    /** From the usage chunk (the request is sent with include_usage). @type {Usage | null} */
    this.usage = null;
    /**
     * @type {{content: string, reasoning: string, calls: Record<string, any>[],
     *   tokens: any[], finish: string | null}[]}
     */
    this.choices = [];
  }

  /** @param {ChatCompletionChunk} chunk */
  add(chunk) {
    this.first ??= chunk;
    if (chunk.usage) this.usage = chunk.usage;
    for (const { index, delta, logprobs, finish_reason } of chunk.choices) {
      const choice = (this.choices[index] ??=
        { content: "", reasoning: "", calls: [], tokens: [], finish: null });
      choice.content += delta.content ?? "";
      choice.reasoning += delta.reasoning_content ?? "";
      for (const { index: at, id, type, function: fn } of delta.tool_calls ?? []) {
        // A call's first piece has its id and name; later pieces add to its arguments.
        const call = (choice.calls[at] ??=
          { id, type: type ?? "function", function: { name: fn?.name ?? "", arguments: "" } });
        call.function.arguments += fn?.arguments ?? "";
      }
      choice.tokens.push(...(logprobs?.content ?? []));
      choice.finish = finish_reason ?? choice.finish;
    }
  }

  /**
   * The body, once the request is over. @param {Usage} usage the `done` message's, used
   * should no usage chunk have come
   */
  body(usage) {
    const { id, created, model, system_fingerprint } =
      /** @type {ChatCompletionChunk} */ (this.first);
    const choices = Array.from(this.choices, (choice, index) => {
      const calls = (choice?.calls ?? []).filter(Boolean);
      const content = choice?.content ?? "";
      /** @type {Record<string, any>} */
      const message = {
        role: "assistant",
        content: calls.length && !content ? null : content,
        refusal: null,
        annotations: [],
      };
      if (calls.length) message.tool_calls = calls;
      if (choice?.reasoning) message.reasoning_content = choice.reasoning;
      return {
        index,
        message,
        logprobs: this.logprobs ? { content: choice?.tokens ?? [], refusal: null } : null,
        // A choice still open when the request ended was cut short with it.
        finish_reason: choice?.finish ?? "stop",
      };
    });
    return {
      id,
      object: "chat.completion",
      created,
      model,
      system_fingerprint,
      choices,
      usage: this.usage ?? usage,
    };
  }
}
