"""Typed errors shared by every side of rollfleet.

Each error has a stable ``code`` (what travels on the wire) and a ``retryable`` flag
(whether the same request may succeed if tried again later).
"""

from __future__ import annotations


class RollfleetError(Exception):
    """Base of every rollfleet error."""

    code: str = "internal"
    retryable: bool = False

    def __init__(self, message: str = "", *, detail: str | None = None) -> None:
        super().__init__(message or self.__class__.__doc__ or self.code)
        self.message = message or (self.__class__.__doc__ or self.code).strip()
        self.detail = detail

    def __repr__(self) -> str:
        return f"{type(self).__name__}(code={self.code!r}, retryable={self.retryable}, {self.message!r})"


# -- request path -------------------------------------------------------------------------


class NoCompatibleReplica(RollfleetError):
    """No live replica is at, or preparing, a version the request accepts."""

    code = "no_compatible_replica"
    retryable = True


class Expired(RollfleetError):
    """The job was not served before its deadline."""

    code = "expired"
    retryable = True


class Interrupted(RollfleetError):
    """An at_most_once job's holder died; it was not run again."""

    code = "interrupted"
    retryable = True


class Cancelled(RollfleetError):
    """The caller cancelled the job before a replica started generating it."""

    code = "cancelled"
    retryable = False


class Superseded(RollfleetError):
    """Another run of this job took it over (its worker was taken for dead): this run's
    checkpoints and answer are not stored."""

    code = "superseded"
    retryable = False


class InvalidRequest(RollfleetError):
    """The request is malformed or asks for something impossible."""

    code = "invalid_request"
    retryable = False


class Fenced(InvalidRequest):
    """The broker refused a write made on the condition that the subject's last stored message
    be ``expected_seq`` (``Nats-Expected-Last-Subject-Sequence``): someone else wrote there since."""

    code = "fenced"

    def __init__(self, message: str = "", *, subject: str = "", expected_seq: int | None = None) -> None:
        super().__init__(message)
        self.subject = subject
        self.expected_seq = expected_seq


class CorruptCheckpoint(InvalidRequest):
    """A resumable job's stored progress cannot be continued (undecodable, or not a prefix of
    this job's output); the job is generated again from its first token."""

    code = "corrupt_checkpoint"


class UnsupportedSchema(InvalidRequest):
    """The job was written for a newer schema than this worker's, or carries a field value this
    worker cannot decode: upgrade the worker (it is answered, never run)."""

    code = "unsupported_schema"

    def __init__(
        self,
        message: str = "",
        *,
        schema: int | None = None,
        supported: int | None = None,
        fields: tuple[str, ...] = (),
    ) -> None:
        super().__init__(message)
        self.schema = schema  # the job's
        self.supported = supported  # the newest this worker decodes
        self.fields = fields  # the job's fields whose values it could not decode


class NotReplayable(RollfleetError):
    """A sample cannot be replayed as asked (``reason``: ``no_coordinate``, ``no_sample``,
    ``resumed``, ``multi_span``, ``unseeded``, ``prompt``: the prompt given is not the one its
    coordinate digests); asking again changes nothing."""

    code = "not_replayable"
    retryable = False

    def __init__(self, message: str = "", *, reason: str = "", index: int | None = None) -> None:
        super().__init__(message)
        self.reason = reason
        self.index = index  # the sample asked for, where one was


class IdempotencyConflict(RollfleetError):
    """The idempotency key was already used for a different request (constraint or payload)."""

    code = "idempotency_conflict"
    retryable = False


class UnknownSession(RollfleetError):
    """No open session has this id (never opened, closed, or expired after its ttl)."""

    code = "unknown_session"
    retryable = False


class SessionConflict(RollfleetError):
    """The session exists with other settings, or the turn is out of order, or its index was
    already asked with another prompt (by a handle whose record of it this one never read)."""

    code = "session_conflict"
    retryable = False


class ClientIdInUse(RollfleetError):
    """Another live client holds this client_id; two would split its results between them."""

    code = "client_id_in_use"
    retryable = True  # once the other client is gone, the same id works again


class ResultUnstorable(RollfleetError):
    """The worker produced a result but the broker refuses to store it (permanently)."""

    code = "result_unstorable"
    retryable = False


class ContractViolation(RollfleetError):
    """A result came back outside the version constraint it was submitted with; it was not used."""

    code = "contract_violation"
    retryable = False


class EngineFailure(RollfleetError):
    """The inference engine failed while serving the request."""

    code = "engine_failure"
    retryable = True


class ServiceUnavailable(RollfleetError):
    """The broker could not be reached or refused the operation."""

    code = "unavailable"
    retryable = True


class AuthorizationError(RollfleetError):
    """The broker refused the credentials (or the operation for this user)."""

    code = "unauthorized"
    retryable = False


class InternalError(RollfleetError):
    """An unexpected error inside rollfleet."""

    code = "internal"
    retryable = False


# -- broker / environment ------------------------------------------------------------------


class BrokerBinaryError(RollfleetError):
    """The nats-server binary is missing or too old."""

    code = "broker_binary"
    retryable = False


# What the broker said to an operation, typed once by ``rollfleet.broker.errors.typed`` from the
# client library's exceptions: code outside ``broker/`` branches on these, never on a library's
# exception, an API error code or a status. A conditional write refused because its key or subject
# moved on is ``Fenced`` (above), not one of these.


class BrokerError(RollfleetError):
    """The broker refused an operation, or did not answer it (``status``, ``err_code``: the
    JetStream API's, where it gave them)."""

    code = "broker_error"
    retryable = True

    def __init__(self, message: str = "", *, status: int | None = None, err_code: int | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.err_code = err_code


class BrokerUnavailable(BrokerError):
    """The broker did not answer (a time-out, the connection redialing, a leader being elected, a
    server error): whether the operation took effect is unknown, and asking again may pass."""

    code = "broker_unavailable"


class BrokerTimeout(BrokerUnavailable, TimeoutError):
    """No answer within the request's time-out: the broker, or whoever the subject reaches, is
    slow, paused or gone without a word. (A ``TimeoutError`` too, as nats' own is: code that
    waits on time-outs of its own and the broker's alike catches both.)"""

    code = "broker_timeout"


class NoResponders(BrokerUnavailable):
    """Nobody listens on the subject: the broker answered at once that no process (or, for a
    JetStream request, no stream or consumer) took the request."""

    code = "no_responders"


class ConnectionClosed(BrokerError):
    """The connection is closed or draining, or no server could be reached: nothing more is
    asked on it."""

    code = "connection_closed"


class NotFound(BrokerError):
    """The broker said nothing lies there: no such key (``deleted``: one deleted or purged), stored
    message, stream, consumer or bucket."""

    code = "not_found"
    retryable = False

    def __init__(
        self, message: str = "", *, status: int | None = None, err_code: int | None = None, deleted: bool = False
    ) -> None:
        super().__init__(message, status=status, err_code=err_code)
        self.deleted = deleted


# -- policy versions -------------------------------------------------------------------------


class PolicyError(RollfleetError):
    """Base of weight publication and materialization errors."""

    code = "policy_error"
    retryable = False


class LayoutMismatch(PolicyError):
    """Tensor names, dtypes, shapes or byte sizes differ from the base layout."""

    code = "layout_mismatch"


class LineageMismatch(PolicyError):
    """A delta's base version is not the version it would be applied to."""

    code = "lineage_mismatch"


class ChecksumMismatch(PolicyError):
    """A tensor's final state does not match its published checksum."""

    code = "checksum_mismatch"


class CorruptArtifact(PolicyError):
    """A version's files are missing, truncated, or inconsistent with the index."""

    code = "corrupt_artifact"


class UnsupportedFormat(PolicyError):
    """Unknown delta encoding, compression or checksum format."""

    code = "unsupported_format"


class HostileName(PolicyError):
    """A file or tensor name would escape its directory."""

    code = "hostile_name"


class DecompressionBomb(CorruptArtifact):
    """A compressed frame would decompress past the tensor's size."""

    code = "decompression_bomb"


class VersionConflict(PolicyError):
    """Another publisher already committed this version number."""

    code = "version_conflict"
    retryable = True


class VersionNotFound(PolicyError):
    """The requested version is not in the store."""

    code = "version_not_found"
    retryable = True


class PrepareTimeout(PolicyError):
    """Preparing a version took longer than its bound (a read that never returns, e.g. a wedged mount)."""

    code = "prepare_timeout"
    retryable = True


class UnsupportedStore(PolicyError):
    """A policy store address rollfleet cannot serve (an unknown URL scheme, or a missing extra)."""

    code = "unsupported_store"


class StoreUnavailable(PolicyError):
    """The object store did not answer (network, throttling, a server error): try again later."""

    code = "store_unavailable"
    retryable = True


class StoreAccessDenied(PolicyError):
    """The object store refused the credentials (missing, wrong or without permission)."""

    code = "store_access_denied"


class LocalDiskError(PolicyError):
    """The replica's own disk refused a write (full, read-only, over a file size limit, failing):
    the local checkpoint was left at its last good version, or with no marker; try again later."""

    code = "local_disk_error"
    retryable = True  # a disk that is freed, remounted or replaced takes the same write

    def __init__(self, message: str = "", *, errno_name: str = "", path: str | None = None) -> None:
        super().__init__(message)
        self.errno_name = errno_name  # e.g. ENOSPC, EFBIG, EROFS, EACCES
        self.path = path  # the file the write was refused for, where the OS said


class NoServableVersion(PolicyError):
    """At start-up, no committed version at or below the latest could be materialized and verified."""

    code = "no_servable_version"
    retryable = True  # a later commit (or a repaired store) can be served

    def __init__(self, message: str = "", *, latest: int = -1, failures: dict[int, str] | None = None) -> None:
        super().__init__(message)
        self.latest = latest
        self.failures = dict(failures or {})  # version -> the code of the error that refused it


_BY_CODE: dict[str, type[RollfleetError]] = {}


def _register(cls: type[RollfleetError]) -> None:
    for sub in cls.__subclasses__():
        _BY_CODE.setdefault(sub.code, sub)
        _register(sub)


_register(RollfleetError)
_BY_CODE.setdefault(RollfleetError.code, InternalError)


def error_class(code: str) -> type[RollfleetError]:
    """The error class for a wire code; unknown codes map to InternalError."""
    return _BY_CODE.get(code, InternalError)


def error_from_code(code: str, message: str, retryable: bool | None = None) -> RollfleetError:
    """Rebuild a typed error from its wire form."""
    err = error_class(code)(message)
    if retryable is not None and retryable != err.retryable:
        err.retryable = retryable  # the sender's judgement wins for this instance
    return err
