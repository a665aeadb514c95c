"""The runner package's errors, all under one base.

    RunnerError                    anything the runner raises on purpose
    ├── Unauthorized               the gateway refused this runner's credentials
    ├── GatewaySilent              no frame from the gateway for the liveness timeout
    ├── AmbiguousGateway           several gateways answer on the LAN and none was named
    ├── UntrustedGateway           a TLS gateway did not prove it knows the runner token,
    │                              or showed another authority than the pinned one
    └── EngineError                an engine could not do what it was asked
        ├── EngineStateError       a call the engine's state forbids (submit before start,
        │                          start twice); also a RuntimeError
        ├── ModelLoadError         `start` could not load a model; the loader's error is
        │   │                      its __cause__
        │   ├── DownloadError      a Hugging Face model could not be fetched (not found,
        │   │                      gated, no network, disk full, stalled); the message says
        │   │                      what to do, the hub client's error is its __cause__
        │   └── AdapterError       a LoRA adapter that cannot be used (runner.adapter)
        └── RequestError           one request this engine cannot serve; it ends that request
                                   with a Failure of its `code`, never reaching the caller

The transport (runner.client) raises `Unauthorized` out of `Runner.run`; `GatewaySilent`
only ends one connection, which is then made again. Engines raise `EngineStateError` and
`ModelLoadError` to their caller (`runner.download.fetch` raises `DownloadError`);
`RequestError` is raised and caught on an engine's own thread and turned into a `Failure` event.
"""

from __future__ import annotations

from protocol.frames import ErrorCode


class RunnerError(Exception):
    """Base of every error the runner package raises on purpose."""


class Unauthorized(RunnerError):
    """The gateway refused this runner's credentials; retrying would not help."""


class GatewaySilent(RunnerError):
    """No frame from the gateway for longer than the liveness timeout."""


class AmbiguousGateway(RunnerError):
    """Several gateways answer on the LAN and the runner was not told which to join; the
    message lists them."""


class UntrustedGateway(RunnerError):
    """A gateway serving TLS did not prove it knows the runner token for the certificate it
    showed, or showed another certificate authority than the pinned one (`runner.pinning`);
    the token was not sent."""


class EngineError(RunnerError):
    """An engine could not do what it was asked."""


class EngineStateError(EngineError, RuntimeError):
    """A call the engine's state does not allow: `submit` before `start`, `start` twice.

    Also a RuntimeError, which is what a caller misusing an object usually catches.
    """


class ModelLoadError(EngineError):
    """`Engine.start` could not load a model (missing files, unknown architecture...)."""


class DownloadError(ModelLoadError):
    """`runner.download.fetch` could not make a model available locally; the message names
    the model and what to do about it."""


class AdapterError(ModelLoadError):
    """A LoRA adapter that cannot be used (runner.adapter); the message says why, in one
    line."""


class RequestError(EngineError):
    """A request this engine cannot serve; it ends with a Failure of `code`."""

    def __init__(self, code: ErrorCode, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.code: ErrorCode = code
        self.param = param
        """The request parameter at fault, as OpenAI names it."""
