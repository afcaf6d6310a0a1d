"""The project's typed errors (DESIGN.md §3).

Every error carries an HTTP status and an OpenAI-style ``type`` so that servers can turn any
of them into the same JSON error shape.
"""

from __future__ import annotations


class KVPoolError(Exception):
    """Base class of every kvpool error."""

    http_status = 500
    error_type = "internal_error"

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param

    def to_openai(self) -> dict:
        """The OpenAI error body: ``{"error": {"message", "type", "param", "code"}}``."""
        return {
            "error": {
                "message": self.message,
                "type": self.error_type,
                "param": self.param,
                "code": self.http_status,
            }
        }


class BadRequestError(KVPoolError, ValueError):
    """The caller sent something invalid."""

    http_status = 400
    error_type = "invalid_request_error"


class NotFoundError(KVPoolError, KeyError):
    """A named thing (model, key, request) does not exist."""

    http_status = 404
    error_type = "not_found_error"

    def __str__(self) -> str:  # KeyError would otherwise repr() the message
        return self.message


class AlreadyExistsError(KVPoolError):
    http_status = 409
    error_type = "conflict_error"


class NoSpaceError(KVPoolError):
    """No memory/capacity left for the request, now or ever."""

    http_status = 503
    error_type = "no_capacity_error"


class LeaseExpiredError(KVPoolError):
    http_status = 409
    error_type = "lease_expired_error"


class KVPoolTimeoutError(KVPoolError, TimeoutError):
    http_status = 504
    error_type = "timeout_error"


class TransferError(KVPoolError):
    http_status = 502
    error_type = "transfer_error"


class BackpressureError(KVPoolError):
    http_status = 429
    error_type = "overloaded_error"


class ProtocolError(KVPoolError):
    http_status = 400
    error_type = "protocol_error"


class RejectedError(KVPoolError):
    """Early rejection by admission control or overload (HTTP 429 with Retry-After)."""

    http_status = 429
    error_type = "rate_limit_error"

    def __init__(self, message: str, *, retry_after: float = 1.0, reason: str = "overload") -> None:
        super().__init__(message)
        self.retry_after = retry_after
        self.reason = reason


class ModelLoadError(KVPoolError):
    """A model could not be found or loaded."""

    http_status = 500
    error_type = "model_load_error"


class UnavailableError(KVPoolError):
    """Temporarily unable to answer (a leader election or a table rebuild): retry shortly."""

    http_status = 503
    error_type = "unavailable_error"


class RoomPendingError(UnavailableError):
    """No room for a put yet: the pool is moving colder objects to SSD to make some. The store
    client retries the put by itself, for a moment."""

    error_type = "room_pending_error"


class ConnectionLostError(UnavailableError):
    """A control-plane peer could not be reached, or dropped the connection mid-call."""


class PutInProgressError(KVPoolError):
    """Another put of the same key has started and not ended: nothing is readable yet (never
    reported as "already exists", which only ever means a complete object)."""

    http_status = 409
    error_type = "conflict_error"


class AuthError(KVPoolError):
    """A missing or wrong shared secret (the cluster token, the admin token or an API key), or
    a peer that could not prove it holds the cluster token."""

    http_status = 401
    error_type = "authentication_error"


class ForbiddenError(KVPoolError):
    """An authenticated caller asked for something its role does not allow (an admin call)."""

    http_status = 403
    error_type = "permission_error"


class PayloadTooLargeError(KVPoolError):
    """A request body or message over the size the receiver accepts."""

    http_status = 413
    error_type = "invalid_request_error"
