// Orchard's browser client for the gateway's WebSocket API (docs/websocket-api.md).
// A dependency-free ES module (with its siblings openai-http.js and socket-link.js):
// `import { OrchardClient } from "/static/orchard.js"`.
//
// One socket carries every request. When it drops, the requests it carried fail with
// "connection lost" (the gateway cancels them); new requests wait in a queue while the client
// reconnects with exponential backoff and jitter, and pool subscriptions are sent again.
// A refusal (wrong API key, origin not allowed) is final until setApiKey().
// `client.fetch` lets the openai SDK (or any fetch caller) use the socket as the HTTP API.

import { badRequest, chunkJson, CompletionBody, errorResponse, SSE_DONE } from "./openai-http.js";
import {
  clientError, defaultUrl, LinkedClient, MAX_MESSAGE_BYTES, OrchardError, PushStream, tooLarge,
} from "./socket-link.js";

export { MAX_MESSAGE_BYTES, OrchardError };

/** @typedef {import("./socket-link.js").OpenAIErrorBody} OpenAIErrorBody */
/** @typedef {import("./socket-link.js").ConnectionStatus} ConnectionStatus */
/**
 * @typedef {{prompt_tokens: number, completion_tokens: number, total_tokens: number,
 *   prompt_tokens_details: {cached_tokens: number},
 *   completion_tokens_details: {reasoning_tokens: number}}} Usage
 */
/** @typedef {{finishReason: "stop" | "length" | "cancelled", usage: Usage}} Done */
/** @typedef {Record<string, any>} ChatCompletionChunk an OpenAI `chat.completion.chunk` */
/** @typedef {Record<string, any>} PoolState a `pool.state` message (see the docs) */

/** One chat completion in progress: iterate it (or `.chunks`) and await `.usage`. */
export class Completion {
  /** @param {OrchardClient} client @param {string} requestId */
  constructor(client, requestId) {
    this.client = client;
    /** The id this client chose (crypto.randomUUID()); the gateway echoes it on every message. */
    this.requestId = requestId;
    /** @type {PushStream<ChatCompletionChunk>} */
    this.chunks = new PushStream();
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

export class OrchardClient extends LinkedClient {
  /**
   * @param {string} [url] the gateway's `/v1/ws`; by default on the page's own host
   * @param {import("./socket-link.js").ClientOptions} [options]
   */
  constructor(url = defaultUrl("/v1/ws"), options = {}) {
    super(url, options);
    /** Requests not yet ended, in creation order; `sent` ones ride on the current socket. */
    /** @type {Map<string, {completion: Completion, frame: string, sent: boolean}>} */
    this.requests = new Map();
    /** @type {{resolve: (ms: number) => void, reject: (e: Error) => void, sentAt: number | null}[]} */
    this.pings = [];
    /** @type {Set<(state: PoolState) => void>} */ this.poolCallbacks = new Set();
    // The openai SDK calls its fetch with no `this`.
    this.fetch = this.fetch.bind(this);
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
    } else if (tooLarge(frame)) {
      this.finish(completion, /** @type {OrchardError} */ (tooLarge(frame)));
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

  /** Close for good: pending requests and pings fail with "client closed". */
  close() {
    if (this.closed) return;
    this.closed = true;
    this.failAll(() => clientError("The client is closed.", "client_closed"), true);
    this.link.close();
  }

  // --- connection ------------------------------------------------------------------------

  /** @protected */
  ready() {
    if (this.poolCallbacks.size) this.send({ type: "pool.subscribe" });
    this.flush();
  }

  /** @protected @param {OrchardError | null} refusal */
  lost(refusal) {
    if (refusal) this.failAll(() => new OrchardError(refusal.error), true);
    // Requests on the lost socket are gone (the gateway cancels them); queued ones wait.
    else this.failAll(() => clientError("connection lost", "connection_lost"), false);
  }

  /** @protected @param {Record<string, any>} message @param {string} data */
  message(message, data) {
    this.receive(message, data);
  }

  /** @private @param {Record<string, any>} message */
  send(message) {
    this.link.send(message);
  }

  /** Send the queued requests and pings, once connected. @private */
  flush() {
    if (!this.link.isOpen) return;
    for (const entry of this.requests.values()) {
      if (!entry.sent) entry.sent = this.link.sendText(entry.frame);
    }
    for (const ping of this.pings) {
      if (ping.sentAt !== null) continue;
      ping.sentAt = performance.now();
      this.link.sendText('{"type":"ping"}');
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

  /** @private @param {Record<string, any>} message @param {string} data */
  receive(message, data) {
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
      case "pool.state":
        for (const callback of this.poolCallbacks) callback(message);
        break;
    }
  }
}
