// What Orchard's two browser clients share (orchard.js on /v1/ws, responses-socket.js on
// the Responses API's WebSocket mode at /v1/responses): the error class, a push-fed async
// iterator, and `SocketLink`, one gateway socket kept open: the `auth` message first when
// there is an API key, reconnection with exponential backoff and jitter after a drop, and a
// refusal (wrong API key, origin not allowed) that is final until setApiKey().

/** @typedef {{message: string, type: string, param: string | null, code: string | null}} OpenAIErrorBody */
/** @typedef {"connecting" | "open" | "refused" | "closed"} ConnectionStatus */
/**
 * A client's options. apiKey is sent in an `auth` message first thing on every connection
 * (browsers cannot set headers on a WebSocket); onStatus hears every connection change;
 * onError hears errors not tied to a request (by default logged with console.warn).
 * @typedef {{apiKey?: string, onStatus?: (status: ConnectionStatus) => void,
 *   onError?: (error: OpenAIErrorBody) => void}} ClientOptions
 */

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
  /** @param {OpenAIErrorBody} error @param {number | null} [status] the HTTP status the same
   *  request would have got, where the gateway says it (the Responses socket's error events) */
  constructor(error, status = null) {
    super(error.message);
    this.name = "OrchardError";
    /** @type {OpenAIErrorBody} */
    this.error = error;
    /** @type {number | null} */
    this.status = status;
  }
}

/** @param {string} message @param {string} code @returns {OrchardError} */
export function clientError(message, code) {
  return new OrchardError({ message, type: "connection_error", param: null, code });
}

/** @param {string} frame @returns {OrchardError | null} the refusal of a message too large */
export function tooLarge(frame) {
  if (new TextEncoder().encode(frame).length <= MAX_MESSAGE_BYTES) return null;
  // The gateway would refuse it without naming the request; refuse it here instead.
  const message = `The request is over the ${MAX_MESSAGE_BYTES}-byte message limit.`;
  return new OrchardError({
    message, type: "invalid_request_error", param: null, code: "message_too_large",
  });
}

/** `path` on the page's own host, ws: or wss: to match the page. @param {string} path */
export function defaultUrl(path) {
  const scheme = globalThis.location?.protocol === "https:" ? "wss:" : "ws:";
  return `${scheme}//${globalThis.location?.host}${path}`;
}

/**
 * A push-fed async iterator: items are buffered until read; an error ends it by throwing.
 * @template T
 * @implements {AsyncIterableIterator<T>}
 */
export class PushStream {
  constructor() {
    /** @type {T[]} */ this.buffer = [];
    /** A reader waiting for the next item. @type {{resolve: Function, reject: Function}[]} */
    this.waiting = [];
    this.ended = false;
    /** @type {Error | null} */ this.error = null;
  }

  /** @param {T} item */
  push(item) {
    if (this.ended) return;
    const reader = this.waiting.shift();
    if (reader) reader.resolve({ value: item, done: false });
    else this.buffer.push(item);
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

  /** @returns {Promise<IteratorResult<T>>} */
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

  /** Leaving a `for await` loop early stops reading (later items are dropped), not the request. */
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

/**
 * @typedef {object} LinkHooks
 * @property {() => void} onReady connected (and authenticated): send what waited
 * @property {(message: Record<string, any>, data: string) => void} onMessage every message
 *   but `auth.ok`, parsed (`data`: its text as the gateway sent it)
 * @property {(refusal: OrchardError | null) => void} onLost the socket dropped (`null`: the
 *   link reconnects) or was refused (final until setApiKey)
 * @property {(error: OpenAIErrorBody) => void} onError what is wrong with the gateway's output
 * @property {(status: ConnectionStatus) => void} onStatus every connection change
 */

/** One gateway socket, kept open. */
export class SocketLink {
  /** @param {string} url @param {string | null} apiKey @param {LinkHooks} hooks */
  constructor(url, apiKey, hooks) {
    this.url = url;
    /** Sent in an `auth` message first thing on every connection (browsers cannot set
     *  headers on a WebSocket). @type {string | null} */
    this.apiKey = apiKey || null;
    this.hooks = hooks;
    /** Why the gateway refused us, while it does. @type {OrchardError | null} */
    this.refusal = null;
    /** @type {ConnectionStatus} */ this.status = "connecting";
    /** @type {WebSocket | null} */ this.socket = null;
    /** The socket is open and, when there is a key, authenticated. */
    this.ready = false;
    this.attempt = 0;
    /** @type {ReturnType<typeof setTimeout> | null} */ this.retryTimer = null;
    this.closed = false;
    this.connect();
  }

  /** @returns {boolean} open and authenticated: what is sent now goes out */
  get isOpen() {
    return this.ready && this.socket?.readyState === WebSocket.OPEN;
  }

  /** Send `text` if the socket is open. @param {string} text @returns {boolean} sent */
  sendText(text) {
    if (!this.isOpen) return false;
    this.socket?.send(text);
    return true;
  }

  /** @param {Record<string, any>} message @returns {boolean} sent */
  send(message) {
    return this.sendText(JSON.stringify(message));
  }

  /** Use another API key from the next connection on; after a refusal, reconnect at once.
   *  @param {string | null} apiKey */
  setApiKey(apiKey) {
    this.apiKey = apiKey || null;
    if (this.refusal && !this.closed) {
      this.refusal = null;
      this.attempt = 0;
      this.connect();
    }
  }

  /** Close for good. */
  close() {
    if (this.closed) return;
    this.closed = true;
    if (this.retryTimer !== null) clearTimeout(this.retryTimer);
    this.socket?.close(1000);
    this.setStatus("closed");
  }

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
        this.hooks.onLost(this.refusal);
        this.setStatus("refused");
        return;
      }
      this.hooks.onLost(null);
      if (performance.now() - openedAt > STABLE_MS) this.attempt = 0;
      const delay = Math.min(BACKOFF_MAX_MS, BACKOFF_MIN_MS * 2 ** this.attempt++);
      this.setStatus("connecting");
      // Full jitter on the upper half, so many tabs do not reconnect in step.
      this.retryTimer = setTimeout(() => this.connect(), delay / 2 + Math.random() * (delay / 2));
    };
  }

  /** @private */
  becomeReady() {
    this.ready = true;
    this.setStatus("open");
    this.hooks.onReady();
  }

  /** @private @param {ConnectionStatus} status */
  setStatus(status) {
    if (this.status === status) return;
    this.status = status;
    this.hooks.onStatus(status);
  }

  /** @private @param {string} data */
  receive(data) {
    let message;
    try {
      message = JSON.parse(data);
    } catch {
      const text = "The gateway sent invalid JSON.";
      this.hooks.onError({ message: text, type: "client_error", param: null, code: null });
      return;
    }
    if (message === null || typeof message !== "object" || typeof message.type !== "string") {
      const text = "The gateway sent a message that is not an event.";
      this.hooks.onError({ message: text, type: "client_error", param: null, code: null });
      return;
    }
    if (message.type === "auth.ok") this.becomeReady();
    else this.hooks.onMessage(message, data);
  }
}

/**
 * What both clients are on their link: `status`, `socket`, `refusal`, `setApiKey`; the
 * subclass's `ready`, `message` and `lost` (LinkHooks' onReady, onMessage, onLost) act on it.
 */
export class LinkedClient {
  /** @param {string} url @param {ClientOptions} options */
  constructor(url, { apiKey, onStatus, onError }) {
    this.url = url;
    this.onError = onError ?? ((error) => console.warn("orchard:", error.message));
    this.closed = false;
    // The hooks run only once the socket has events: after the subclass's constructor.
    this.link = new SocketLink(url, apiKey ?? null, {
      onReady: () => this.ready(),
      onMessage: (message, data) => this.message(message, data),
      onLost: (refusal) => this.lost(refusal),
      onError: (error) => this.onError(error),
      onStatus: onStatus ?? (() => {}),
    });
  }

  /** @returns {ConnectionStatus} */
  get status() {
    return this.link.status;
  }

  /** The socket now, if any. @returns {WebSocket | null} */
  get socket() {
    return this.link.socket;
  }

  /** Why the gateway refused us, while it does. @returns {OrchardError | null} */
  get refusal() {
    return this.link.refusal;
  }

  /**
   * Use another API key from the next connection on; after a refusal, reconnect at once.
   * @param {string | null} apiKey
   */
  setApiKey(apiKey) {
    this.link.setApiKey(apiKey);
  }

  /** Connected (and authenticated): send what waited. @protected */
  ready() {}

  /** @protected @param {Record<string, any>} message @param {string} data */
  message(message, data) {}

  /** @protected @param {OrchardError | null} refusal */
  lost(refusal) {}
}
