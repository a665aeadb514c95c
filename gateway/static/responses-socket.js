// Orchard's browser client for the Responses API's WebSocket mode (docs/responses-websocket.md):
// what OpenAI's SDK calls `client.responses.connect()`, for pages. A dependency-free ES module
// (with its sibling socket-link.js):
// `import { ResponsesSocket } from "/static/responses-socket.js"`.
//
// One socket carries every response. Each `create` runs on a `stream_id` lane: its own fresh
// lane unless `streamId` names one (the creates of a lane run one after another, lanes at
// once). The gateway's events are routed back by `stream_id` to the create they belong to.
// When the socket drops, the responses it carried fail with "connection lost" (the gateway
// cancels them); new creates wait while the client reconnects with backoff and jitter. A
// refusal (wrong API key, origin not allowed) is final until setApiKey().

import {
  clientError, defaultUrl, LinkedClient, OrchardError, PushStream, tooLarge,
} from "./socket-link.js";

export { OrchardError };

/** @typedef {import("./socket-link.js").OpenAIErrorBody} OpenAIErrorBody */
/** @typedef {import("./socket-link.js").ConnectionStatus} ConnectionStatus */
/** @typedef {Record<string, any>} ResponseEvent a Responses streaming event, as over SSE */
/** @typedef {Record<string, any>} ResponseObject an OpenAI `response` object */
/** @typedef {{id: string, previous_response_id: string}} Steer */

/** The events that end a response. */
const ENDS = new Set(["response.completed", "response.incomplete", "response.failed"]);
/** OpenAI's pattern for a `stream_id`. */
const STREAM_ID = /^[A-Za-z0-9_.-]{1,256}$/;

/** One response on the socket: iterate its events (or `.events`), await `.response`. */
export class ResponseStream {
  /** @param {ResponsesSocket} client @param {string} streamId */
  constructor(client, streamId) {
    this.client = client;
    /** Its lane. */
    this.streamId = streamId;
    /** The response's id, once its `response.created` came. @type {string | null} */
    this.id = null;
    /** Every event of the response; an `error` event (or a lost socket) ends it by throwing.
     *  @type {PushStream<ResponseEvent>} */
    this.events = new PushStream();
    /** @type {(id: string) => void} */ let started = () => {};
    /** @type {(response: ResponseObject) => void} */ let resolve = () => {};
    /** @type {(e: OrchardError) => void} */ let reject = () => {};
    /** @type {(e: OrchardError) => void} */ let refuse = () => {};
    /** Resolves with the response's id at its `response.created` (the commit point); rejects
     *  with the OrchardError that ended it before. @type {Promise<string>} */
    this.started = new Promise((yes, no) => { started = yes; refuse = no; });
    /** Resolves with the final response object (`completed` or `incomplete`); rejects with an
     *  OrchardError: an `error` event (with the HTTP `status` it stands for), the response's
     *  own error when it `failed`, or a lost socket. @type {Promise<ResponseObject>} */
    this.response = new Promise((yes, no) => { resolve = yes; reject = no; });
    // A caller that reads only one of them still sees the error there; no unhandled rejection.
    this.started.catch(() => {});
    this.response.catch(() => {});
    this.settle = { started, resolve, reject, refuse };
    /** The create's message; null for a steer's successor, which the gateway makes itself.
     *  @type {string | null} */
    this.frame = null;
    this.sent = false;
  }

  /**
   * Steer it: the gateway stops it at its next token (it ends `incomplete`, reason
   * `steered`) and its successor continues the conversation with `input`. Waits for the
   * response to have started. @param {string | Record<string, any>[]} input
   * @returns {Promise<{steer: Steer, successor: ResponseStream}>}
   */
  async steer(input) {
    return this.client.steer(await this.started, input);
  }

  /** Take the next event of its lane (ResponsesSocket's part): true when it ended it.
   *  @param {ResponseEvent} event @returns {boolean} */
  take(event) {
    if (event.type === "response.created" && this.id === null) {
      this.id = event.response?.id ?? null;
      if (this.id !== null) this.settle.started(this.id);
    }
    this.events.push(event);
    if (!ENDS.has(event.type)) return false;
    this.events.end();
    const response = event.response ?? {};
    if (event.type === "response.failed") {
      const error = response.error ?? {};
      const body = {
        message: error.message ?? "The response failed.", type: "server_error", param: null,
        code: error.code ?? null,
      };
      this.fail(new OrchardError(body));
    } else {
      this.settle.resolve(response);
    }
    return true;
  }

  /** End it with `error` (ResponsesSocket's part). @param {OrchardError} error */
  fail(error) {
    this.events.end(error);
    this.settle.refuse(error);
    this.settle.reject(error);
  }

  [Symbol.asyncIterator]() {
    return this.events;
  }
}

export class ResponsesSocket extends LinkedClient {
  /**
   * @param {string} [url] the gateway's `/v1/responses` as a WebSocket; by default on the
   *   page's own host
   * @param {import("./socket-link.js").ClientOptions} [options] (onError: the error events
   *   that name no lane)
   */
  constructor(url = defaultUrl("/v1/responses"), options = {}) {
    super(url, options);
    /** The responses not yet ended, per lane, in the order they run there.
     *  @type {Map<string, ResponseStream[]>} */
    this.lanes = new Map();
    /** Steers sent and not yet answered, per response id, in the order sent.
     *  @type {Map<string, {resolve: Function, reject: Function}[]>} */
    this.steers = new Map();
    /** The successor waiting behind each steered response, by the steered one's id.
     *  @type {Map<string, ResponseStream>} */
    this.successors = new Map();
  }

  /**
   * Start a response. `body` is a `POST /v1/responses` body (`stream` is implied).
   * @param {Record<string, any>} body
   * @param {{streamId?: string}} [options] the lane: a fresh one unless given
   * @returns {ResponseStream}
   */
  create(body, { streamId } = {}) {
    const lane = streamId ?? `lane-${crypto.randomUUID()}`;
    const run = new ResponseStream(this, lane);
    const frame = JSON.stringify({ ...body, type: "response.create", stream_id: lane });
    const refusal = this.closed ? clientError("The client is closed.", "client_closed")
      : this.refusal ? new OrchardError(this.refusal.error)
      : !STREAM_ID.test(lane) ? new OrchardError({
        message: "stream_id must be 1 to 256 of A-Z a-z 0-9 _ . -", type: "invalid_request_error",
        param: "stream_id", code: "invalid_value",
      }, 400)
      : tooLarge(frame);
    if (refusal) {
      run.fail(refusal);
      return run;
    }
    run.frame = frame;
    const runs = this.lanes.get(lane) ?? [];
    runs.push(run);
    this.lanes.set(lane, runs);
    this.flush();
    return run;
  }

  /**
   * Steer the response `responseId` that runs on this socket (`response.steer`).
   * @param {string} responseId @param {string | Record<string, any>[]} input
   * @returns {Promise<{steer: Steer, successor: ResponseStream}>} rejects with an
   *   OrchardError (its `.error.code` says why: `response_already_completed`, …)
   */
  steer(responseId, input) {
    if (this.closed) return Promise.reject(clientError("The client is closed.", "client_closed"));
    const message = { type: "response.steer", previous_response_id: responseId, input };
    return new Promise((resolve, reject) => {
      if (!this.link.send(message)) {
        reject(clientError("Not connected: the response is not on this socket.", "not_connected"));
        return;
      }
      const waiting = this.steers.get(responseId) ?? [];
      waiting.push({ resolve, reject });
      this.steers.set(responseId, waiting);
    });
  }

  /** Close for good: the responses not ended fail with "client closed" (the gateway cancels
   *  those that run). */
  close() {
    if (this.closed) return;
    this.closed = true;
    this.failAll(() => clientError("The client is closed.", "client_closed"), true);
    this.link.close();
  }

  // --- connection ------------------------------------------------------------------------

  /** @protected */
  ready() {
    this.flush();
  }

  /** @protected @param {Record<string, any>} message */
  message(message) {
    this.receive(message);
  }

  /** Send the creates that wait, once connected. @private */
  flush() {
    if (!this.link.isOpen) return;
    for (const runs of this.lanes.values()) {
      for (const run of runs) {
        if (!run.sent && run.frame !== null) run.sent = this.link.sendText(run.frame);
      }
    }
  }

  /** @protected @param {OrchardError | null} refusal */
  lost(refusal) {
    // Responses on the lost socket are gone (the gateway cancelled them); unsent ones wait.
    if (refusal) this.failAll(() => new OrchardError(refusal.error), true);
    else this.failAll(() => clientError("connection lost", "connection_lost"), false);
  }

  /** @private @param {() => OrchardError} error @param {boolean} all */
  failAll(error, all) {
    for (const [lane, runs] of this.lanes) {
      const kept = runs.filter((run) => {
        if (!all && !run.sent) return true;
        run.fail(error());
        return false;
      });
      if (kept.length) this.lanes.set(lane, kept);
      else this.lanes.delete(lane);
    }
    for (const waiting of this.steers.values()) for (const steer of waiting) steer.reject(error());
    this.steers.clear();
    this.successors.clear();
  }

  /** The response running on `lane` now. @private @param {string} lane */
  head(lane) {
    return this.lanes.get(lane)?.[0];
  }

  /** @private @param {string} lane @param {ResponseStream} run */
  remove(lane, run) {
    const runs = (this.lanes.get(lane) ?? []).filter((r) => r !== run);
    if (runs.length) this.lanes.set(lane, runs);
    else this.lanes.delete(lane);
  }

  /** @private @param {Record<string, any>} message */
  receive(message) {
    const lane = typeof message.stream_id === "string" ? message.stream_id : null;
    switch (message.type) {
      case "error": {
        const run = lane === null ? undefined : this.head(lane);
        const error = new OrchardError(message.error, message.status ?? null);
        if (!run) {
          this.onError(message.error);
          break;
        }
        this.remove(lane, run);
        run.fail(error);
        break;
      }
      case "response.steer.accepted":
        this.accepted(message, lane);
        break;
      case "response.steer.failed":
        this.steerFailed(message);
        break;
      default: {
        const run = lane === null ? undefined : this.head(lane);
        if (run && run.take(message)) this.remove(lane, run);
      }
    }
  }

  /** @private @param {Record<string, any>} message @param {string | null} lane */
  accepted(message, lane) {
    const target = message.steer?.previous_response_id;
    const waiting = this.steers.get(target)?.shift();
    if (!waiting || lane === null) return;
    // Its successor runs next on the target's lane, right behind it; later steers of the
    // same response join that successor.
    let successor = this.successors.get(target);
    if (!successor) {
      successor = new ResponseStream(this, lane);
      successor.sent = true;
      this.successors.set(target, successor);
      const runs = this.lanes.get(lane) ?? [];
      const at = runs.findIndex((run) => run.id === target);
      runs.splice(at < 0 ? 0 : at + 1, 0, successor);
      this.lanes.set(lane, runs);
      successor.started.then(() => this.successors.delete(target), () => {});
    }
    waiting.resolve({ steer: message.steer, successor });
  }

  /** @private @param {Record<string, any>} message */
  steerFailed(message) {
    const target = message.steer?.previous_response_id;
    const error = new OrchardError({ param: null, ...message.error });
    if (message.steer?.id != null) {
      // After `accepted`: the steered response ended unstored, so its successor never runs.
      const successor = this.successors.get(target);
      if (successor) {
        this.successors.delete(target);
        this.remove(successor.streamId, successor);
        successor.fail(error);
      }
      return;
    }
    const waiting = this.steers.get(target)?.shift();
    if (waiting) waiting.reject(error);
  }
}
