// Orchard's browser client for the gateway's WebSocket API (docs/websocket-api.md).
// A dependency-free ES module (with its sibling openai-http.js):
// `import { OrchardClient } from "/static/orchard.js"`.
//
// One socket carries every request. When it drops, the requests it carried fail with
// "connection lost" (the gateway cancels them); new requests wait in a queue while the client
// reconnects with exponential backoff and jitter, and pool subscriptions are sent again.
// A refusal (wrong API key, origin not allowed) is final until setApiKey().
// `client.fetch` lets the openai SDK (or any fetch caller) use the socket as the HTTP API.

import { badRequest, chunkJson, CompletionBody, errorResponse, SSE_DONE } from "./openai-http.js";

/** @typedef {{message: string, type: string, param: string | null, code: string | null}} OpenAIErrorBody */
/**
 * @typedef {{prompt_tokens: number, completion_tokens: number, total_tokens: number,
 *   prompt_tokens_details: {cached_tokens: number},
 *   completion_tokens_details: {reasoning_tokens: number}}} Usage
 */
/** @typedef {{finishReason: "stop" | "length" | "cancelled", usage: Usage}} Done */
/** @typedef {Record<string, any>} ChatCompletionChunk an OpenAI `chat.completion.chunk` */
/** @typedef {Record<string, any>} PoolState a `pool.state` message (see the docs) */
/** @typedef {"connecting" | "open" | "refused" | "closed"} ConnectionStatus */

/** Largest message the gateway accepts; bigger ones are refused here, with no round trip. */
export const MAX_MESSAGE_BYTES = 1024 * 1024;
const BACKOFF_MIN_MS = 250;
const BACKOFF_MAX_MS = 8000;
/** A socket open this long counts as a success: the next drop starts the backoff over. */
const STABLE_MS = 5000;
/** Close codes after which retrying cannot help (protocol/closecodes.py). */
const REFUSALS = {
  4004: { type: "authentication_error", code: "invalid_api_key" },
  4011: { type: "permission_error", code: "origin_not_allowed" },
};

/** An error that ends a request; `.error` is the OpenAI error object. */
export class OrchardError extends Error {
  /** @param {OpenAIErrorBody} error */
  constructor(error) {
    super(error.message);
    this.name = "OrchardError";
    /** @type {OpenAIErrorBody} */
    this.error = error;
  }
}

/** @param {string} message @param {string} code @returns {OrchardError} */
function clientError(message, code) {
  return new OrchardError({ message, type: "connection_error", param: null, code });
}

/** The default endpoint: `/v1/ws` on the page's own host, ws: or wss: to match the page. */
function defaultUrl() {
  const scheme = globalThis.location?.protocol === "https:" ? "wss:" : "ws:";
  return `${scheme}//${globalThis.location?.host}/v1/ws`;
}

/**
 * A push-fed async iterator: chunks are buffered until read; an error ends it by throwing.
 * @implements {AsyncIterableIterator<ChatCompletionChunk>}
 */
class ChunkStream {
  constructor() {
    /** @type {ChatCompletionChunk[]} */ this.buffer = [];
    /** A reader waiting for the next chunk. @type {{resolve: Function, reject: Function}[]} */
    this.waiting = [];
    this.ended = false;
    /** @type {Error | null} */ this.error = null;
  }

  /** @param {ChatCompletionChunk} chunk */
  push(chunk) {
    if (this.ended) return;
    const reader = this.waiting.shift();
    if (reader) reader.resolve({ value: chunk, done: false });
    else this.buffer.push(chunk);
  }

  /** @param {Error | null} [error] */
  end(error = null) {
    if (this.ended) return;
    this.ended = true;
    this.error = this.waiting.length ? null : error; // a waiting reader gets it now
    for (const reader of this.waiting.splice(0)) {
      if (error) reader.reject(error);
      else reader.resolve({ value: undefined, done: true });
    }
  }

  /** @returns {Promise<IteratorResult<ChatCompletionChunk>>} */
  next() {
    if (this.buffer.length) return Promise.resolve({ value: this.buffer.shift(), done: false });
    if (this.ended) {
      if (this.error) {
        const error = this.error;
        this.error = null; // thrown once, like any iterator that failed
        return Promise.reject(error);
      }
      return Promise.resolve({ value: undefined, done: true });
    }
    return new Promise((resolve, reject) => this.waiting.push({ resolve, reject }));
  }

  /** Leaving a `for await` loop early stops reading (later chunks are dropped), not the request. */
  return() {
    this.buffer = [];
    this.ended = true;
    this.error = null;
    return Promise.resolve({ value: undefined, done: true });
  }

  [Symbol.asyncIterator]() {
    return this;
  }
}

/** One chat completion in progress: iterate it (or `.chunks`) and await `.usage`. */
export class Completion {
  /** @param {OrchardClient} client @param {string} requestId */
  constructor(client, requestId) {
    this.client = client;
    /** The id this client chose (crypto.randomUUID()); the gateway echoes it on every message. */
    this.requestId = requestId;
    /** @type {AsyncIterableIterator<ChatCompletionChunk>} */
    this.chunks = new ChunkStream();
    /** @type {(d: Done) => void} */ this.resolve = () => {};
    /** @type {(e: OrchardError) => void} */ this.reject = () => {};
    /** Resolves with `{finishReason, usage}`, or rejects with an OrchardError. @type {Promise<Done>} */
    this.usage = new Promise((resolve, reject) => {
      this.resolve = resolve;
      this.reject = reject;
    });
    // A caller that only reads chunks still sees the error there; no unhandled rejection.
    this.usage.catch(() => {});
    /**
     * Set by `fetch()`: takes each chunk, with its JSON text as the gateway sent it, instead of
     * `chunks`. @type {((chunk: ChatCompletionChunk, json: string) => void) | null}
     */
    this.onChunk = null;
  }

  /** Stop generating; the request then ends with finishReason "cancelled". */
  cancel() {
    this.client.cancel(this.requestId);
  }

  [Symbol.asyncIterator]() {
    return this.chunks;
  }
}

export class OrchardClient {
  /**
   * @param {string} [url] the gateway's `/v1/ws`; by default on the page's own host
   * @param {{apiKey?: string, onStatus?: (status: ConnectionStatus) => void,
   *   onError?: (error: OpenAIErrorBody) => void}} [options]
   *   apiKey is sent in an `auth` message first thing on every connection (browsers cannot
   *   set headers on a WebSocket); onStatus hears every connection change; onError hears
   *   errors not tied to a request.
   */
  constructor(url = defaultUrl(), { apiKey, onStatus, onError } = {}) {
    this.url = url;
    /** @type {string | null} */ this.apiKey = apiKey || null;
    /** Why the gateway refused us, while it does. @type {OrchardError | null} */
    this.refusal = null;
    this.onStatus = onStatus ?? (() => {});
    this.onError = onError ?? ((error) => console.warn("orchard:", error.message));
    /** @type {ConnectionStatus} */ this.status = "connecting";
    /** @type {WebSocket | null} */ this.socket = null;
    /** The socket is open and, when there is a key, authenticated. */
    this.ready = false;
    /** Requests not yet ended, in creation order; `sent` ones ride on the current socket. */
    /** @type {Map<string, {completion: Completion, frame: string, sent: boolean}>} */
    this.requests = new Map();
    /** @type {{resolve: (ms: number) => void, reject: (e: Error) => void, sentAt: number | null}[]} */
    this.pings = [];
    /** @type {Set<(state: PoolState) => void>} */ this.poolCallbacks = new Set();
    this.attempt = 0;
    /** @type {ReturnType<typeof setTimeout> | null} */ this.retryTimer = null;
    this.closed = false;
    // The openai SDK calls its fetch with no `this`.
    this.fetch = this.fetch.bind(this);
    this.connect();
  }

  /**
   * Start a streaming chat completion. `body` is a POST /v1/chat/completions body.
   * @param {Record<string, any>} body
   * @returns {Completion}
   */
  create(body) {
    const requestId = crypto.randomUUID();
    const completion = new Completion(this, requestId);
    const frame = JSON.stringify({ type: "chat.completions.create", request_id: requestId, body });
    if (this.closed) {
      this.finish(completion, clientError("The client is closed.", "client_closed"));
    } else if (this.refusal) {
      this.finish(completion, new OrchardError(this.refusal.error));
    } else if (new TextEncoder().encode(frame).length > MAX_MESSAGE_BYTES) {
      // The gateway would refuse it without naming the request; refuse it here instead.
      const message = `The request is over the ${MAX_MESSAGE_BYTES}-byte message limit.`;
      this.finish(completion, new OrchardError({
        message, type: "invalid_request_error", param: null, code: "message_too_large",
      }));
    } else {
      this.requests.set(requestId, { completion, frame, sent: false });
      this.flush();
    }
    return completion;
  }

  /**
   * A `fetch` for the openai SDK: `new OpenAI({fetch: client.fetch, …})` (docs/websocket-api.md).
   * `POST …/chat/completions` goes over this socket and is answered as the HTTP API answers
   * it: Server-Sent Events for `stream: true`, else the `chat.completion` JSON; an error with
   * the HTTP API's status and body; a lost socket as a network error. Aborting `init.signal`,
   * or cancelling the body, cancels the request. Any other request goes to
   * `globalThis.fetch`. Headers are not sent: the socket has authenticated itself.
   * @param {RequestInfo | URL} input @param {RequestInit} [init] @returns {Promise<Response>}
   */
  async fetch(input, init) {
    const isRequest = input instanceof Request;
    const method = (init?.method ?? (isRequest ? input.method : "GET")).toUpperCase();
    const url = new URL(isRequest ? input.url : String(input), globalThis.location?.href);
    if (method !== "POST" || !url.pathname.endsWith("/chat/completions")) {
      return globalThis.fetch(input, init);
    }
    const request = new Request(input, init);
    const text = await request.text();
    request.signal.throwIfAborted(); // as fetch() rejects: with the signal's reason
    let body;
    try {
      body = JSON.parse(text);
    } catch (exc) {
      const reason = exc instanceof Error ? exc.message : String(exc);
      return badRequest(
        `We could not parse the JSON body of your request (${reason}). `
          + "The API expects a JSON object.",
        null,
        "invalid_json",
      );
    }
    // The socket always streams: a plain request is streamed with its usage, then collected.
    const collect = body !== null && typeof body === "object" && !Array.isArray(body)
      && (body.stream === false || body.stream == null);
    if (!collect) return this.respond(this.create(body), request.signal, null);
    if (body.stream_options != null) {
      return badRequest(
        "The 'stream_options' parameter is only allowed when 'stream' is enabled.",
        "stream_options",
        "invalid_parameter_combination",
      );
    }
    const streamed = { ...body, stream: true, stream_options: { include_usage: true } };
    const collected = new CompletionBody(body.logprobs === true);
    return this.respond(this.create(streamed), request.signal, collected);
  }

  /** Cancel a request by id; one still queued here ends at once as "cancelled". @param {string} requestId */
  cancel(requestId) {
    const entry = this.requests.get(requestId);
    if (!entry) return; // already ended: nothing to do
    if (entry.sent) {
      this.send({ type: "cancel", request_id: requestId });
      return;
    }
    const zero = { prompt_tokens: 0, completion_tokens: 0, total_tokens: 0,
      prompt_tokens_details: { cached_tokens: 0 }, completion_tokens_details: { reasoning_tokens: 0 } };
    this.requests.delete(requestId);
    entry.completion.chunks.end();
    entry.completion.resolve({ finishReason: "cancelled", usage: zero });
  }

  /** Round trip to the gateway, in milliseconds (waits for a connection if there is none). */
  ping() {
    if (this.closed) return Promise.reject(clientError("The client is closed.", "client_closed"));
    if (this.refusal) return Promise.reject(new OrchardError(this.refusal.error));
    return new Promise((resolve, reject) => {
      this.pings.push({ resolve, reject, sentAt: null });
      this.flush();
    });
  }

  /**
   * Call `callback` with every `pool.state` (about once a second); returns an unsubscribe.
   * @param {(state: PoolState) => void} callback
   * @returns {() => void}
   */
  subscribePool(callback) {
    this.poolCallbacks.add(callback);
    if (this.poolCallbacks.size === 1) this.send({ type: "pool.subscribe" });
    // The gateway has no unsubscribe: later states are just not delivered to this callback.
    return () => this.poolCallbacks.delete(callback);
  }

  /**
   * Use another API key from the next connection on; after a refusal, reconnect at once.
   * @param {string | null} apiKey
   */
  setApiKey(apiKey) {
    this.apiKey = apiKey || null;
    if (this.refusal && !this.closed) {
      this.refusal = null;
      this.attempt = 0;
      this.connect();
    }
  }

  /** Close for good: pending requests and pings fail with "client closed". */
  close() {
    if (this.closed) return;
    this.closed = true;
    if (this.retryTimer !== null) clearTimeout(this.retryTimer);
    this.failAll(() => clientError("The client is closed.", "client_closed"), true);
    this.socket?.close(1000);
    this.setStatus("closed");
  }

  // --- connection ------------------------------------------------------------------------

  /** @private */
  connect() {
    this.setStatus("connecting");
    const socket = new WebSocket(this.url);
    this.socket = socket;
    this.ready = false;
    let openedAt = Infinity;
    socket.onopen = () => {
      openedAt = performance.now();
      // With a key, nothing else is sent before auth.ok: a refused socket carries no request.
      if (this.apiKey) socket.send(JSON.stringify({ type: "auth", api_key: this.apiKey }));
      else this.becomeReady();
    };
    socket.onmessage = (event) => this.receive(event.data);
    socket.onclose = (event) => {
      if (this.socket !== socket) return;
      this.socket = null;
      this.ready = false;
      if (this.closed) return;
      const refusal = REFUSALS[/** @type {4004 | 4011} */ (event.code)];
      if (refusal) {
        const error = { message: event.reason || "refused", ...refusal, param: null };
        this.refusal = new OrchardError(error);
        this.failAll(() => new OrchardError(error), true);
        this.setStatus("refused");
        return;
      }
      // Requests on the lost socket are gone (the gateway cancels them); queued ones wait.
      this.failAll(() => clientError("connection lost", "connection_lost"), false);
      if (performance.now() - openedAt > STABLE_MS) this.attempt = 0;
      const delay = Math.min(BACKOFF_MAX_MS, BACKOFF_MIN_MS * 2 ** this.attempt++);
      this.setStatus("connecting");
      // Full jitter on the upper half, so many tabs do not reconnect in step.
      this.retryTimer = setTimeout(() => this.connect(), delay / 2 + Math.random() * (delay / 2));
    };
  }

  /** Connected (and authenticated): subscribe again and send what waited. @private */
  becomeReady() {
    this.ready = true;
    this.setStatus("open");
    if (this.poolCallbacks.size) this.send({ type: "pool.subscribe" });
    this.flush();
  }

  /** @private @param {ConnectionStatus} status */
  setStatus(status) {
    if (this.status === status) return;
    this.status = status;
    this.onStatus(status);
  }

  /** @private @returns {boolean} */
  get isOpen() {
    return this.ready && this.socket?.readyState === WebSocket.OPEN;
  }

  /** @private @param {Record<string, any>} message */
  send(message) {
    if (this.isOpen) this.socket?.send(JSON.stringify(message));
  }

  /** Send the queued requests and pings, once connected. @private */
  flush() {
    if (!this.isOpen) return;
    for (const entry of this.requests.values()) {
      if (entry.sent) continue;
      this.socket?.send(entry.frame);
      entry.sent = true;
    }
    for (const ping of this.pings) {
      if (ping.sentAt !== null) continue;
      ping.sentAt = performance.now();
      this.socket?.send('{"type":"ping"}');
    }
  }

  /**
   * Fail the requests (all, or only those sent on the lost socket) and the pings in flight.
   * @private @param {() => OrchardError} error @param {boolean} all
   */
  failAll(error, all) {
    for (const [id, entry] of this.requests) {
      if (!all && !entry.sent) continue;
      this.requests.delete(id);
      this.finish(entry.completion, error());
    }
    this.pings = this.pings.filter((ping) => {
      if (!all && ping.sentAt === null) return true;
      ping.reject(error());
      return false;
    });
  }

  /**
   * The Response of a request made by `fetch()`: SSE as its chunks come or, given
   * `collected`, the completion's JSON once it ends. Settled once, unless `signal` aborts
   * first (which cancels the request).
   * @private @param {Completion} completion @param {AbortSignal} signal
   * @param {CompletionBody | null} collected @returns {Promise<Response>}
   */
  respond(completion, signal, collected) {
    const headers = { "x-request-id": completion.requestId };
    const encoder = new TextEncoder();
    return new Promise((resolve, reject) => {
      /** The SSE body, once the response is out. @type {ReadableStreamDefaultController | null} */
      let sse = null;
      let over = false;
      const end = () => {
        over = true;
        signal.removeEventListener("abort", abort);
        completion.onChunk = () => {}; // what still comes before `done` is dropped
      };
      const abort = () => {
        if (over) return;
        end();
        completion.cancel();
        if (sse) sse.error(signal.reason);
        else reject(signal.reason);
      };
      const open = () => {
        const body = new ReadableStream({
          start: (controller) => { sse = controller; },
          cancel: () => {
            if (over) return;
            end();
            completion.cancel();
          },
        });
        const contentType = { "content-type": "text/event-stream" };
        resolve(new Response(body, { headers: { ...headers, ...contentType } }));
        return /** @type {ReadableStreamDefaultController} */ (sse);
      };
      signal.addEventListener("abort", abort);
      completion.onChunk = (chunk, json) => {
        if (collected) collected.add(chunk);
        else (sse ?? open()).enqueue(encoder.encode(`data: ${json}\n\n`));
      };
      completion.usage.then((done) => {
        if (over) return;
        end();
        if (!collected) {
          const controller = sse ?? open(); // ended before any chunk: only the end
          controller.enqueue(encoder.encode(SSE_DONE));
          controller.close();
        } else if (collected.first) {
          const json = JSON.stringify(collected.body(done.usage));
          const contentType = { "content-type": "application/json" };
          resolve(new Response(json, { headers: { ...headers, ...contentType } }));
        } else {
          const message = "The request ended without an answer."; // as the gateway says it
          const error = { message, type: "server_error", param: null, code: null };
          resolve(errorResponse(error, headers));
        }
      }, (/** @type {OrchardError} */ failure) => {
        if (over) return;
        end();
        const { error } = failure;
        if (error.type === "connection_error") {
          // The socket dropped, or the client was closed: a network error, as fetch has them.
          const networkError = new TypeError(error.message, { cause: failure });
          if (sse) sse.error(networkError);
          else reject(networkError);
        } else if (sse) {
          // After the first byte the HTTP API sends an error event, then the end.
          sse.enqueue(encoder.encode(`data: ${JSON.stringify({ error })}\n\n${SSE_DONE}`));
          sse.close();
        } else {
          resolve(errorResponse(error, headers));
        }
      });
    });
  }

  /** @private @param {Completion} completion @param {OrchardError} error */
  finish(completion, error) {
    completion.chunks.end(error);
    completion.reject(error);
  }

  /** @private @param {string} data */
  receive(data) {
    let message;
    try {
      message = JSON.parse(data);
    } catch {
      const text = "The gateway sent invalid JSON.";
      this.onError({ message: text, type: "client_error", param: null, code: null });
      return;
    }
    const entry = message.request_id == null ? undefined : this.requests.get(message.request_id);
    switch (message.type) {
      case "chunk":
        if (!entry) break;
        if (entry.completion.onChunk) {
          entry.completion.onChunk(message.chunk, chunkJson(data, message));
        } else {
          entry.completion.chunks.push(message.chunk);
        }
        break;
      case "done":
        if (!entry) break;
        this.requests.delete(message.request_id);
        entry.completion.chunks.end();
        entry.completion.resolve({ finishReason: message.finish_reason, usage: message.usage });
        break;
      case "error":
        if (entry) {
          this.requests.delete(message.request_id);
          this.finish(entry.completion, new OrchardError(message.error));
        } else {
          this.onError(message.error);
        }
        break;
      case "pong": {
        // Pongs come back in order, so the oldest ping sent is the one answered.
        const index = this.pings.findIndex((ping) => ping.sentAt !== null);
        if (index < 0) break;
        const [ping] = this.pings.splice(index, 1);
        ping.resolve(performance.now() - /** @type {number} */ (ping.sentAt));
        break;
      }
      case "auth.ok":
        this.becomeReady();
        break;
      case "pool.state":
        for (const callback of this.poolCallbacks) callback(message);
        break;
    }
  }
}
