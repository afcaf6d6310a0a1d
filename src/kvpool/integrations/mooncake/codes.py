"""Mooncake Store's return codes, and kvpool's exceptions mapped onto them."""

from __future__ import annotations

import functools
import logging

from kvpool.common import errors

logger = logging.getLogger("kvpool.integrations.mooncake")

OK, INTERNAL_ERROR, BUFFER_OVERFLOW, NO_AVAILABLE_HANDLE, INVALID_PARAMS = 0, -1, -10, -200, -600
REPLICA_IS_NOT_READY, OBJECT_NOT_FOUND, OBJECT_ALREADY_EXISTS = -703, -704, -705
OBJECT_HAS_LEASE, TRANSFER_FAIL, RPC_FAIL, UNAVAILABLE_IN_CURRENT_STATUS = -706, -800, -900, -1010


class StateError(errors.KVPoolError):
    """Called before ``setup``, after ``close``, or ``setup`` on a live store."""


_CODES: list[tuple[type[BaseException] | tuple, int]] = [
    (StateError, UNAVAILABLE_IN_CURRENT_STATUS),
    (errors.NotFoundError, OBJECT_NOT_FOUND),
    (errors.PutInProgressError, REPLICA_IS_NOT_READY),  # another put of it has not ended
    (errors.AlreadyExistsError, OBJECT_ALREADY_EXISTS),
    (errors.LeaseExpiredError, OBJECT_HAS_LEASE),  # kvpool's "remove refused: leased"
    (errors.NoSpaceError, NO_AVAILABLE_HANDLE),
    ((errors.TransferError, errors.BackpressureError), TRANSFER_FAIL),
    ((errors.KVPoolTimeoutError, errors.ProtocolError, errors.UnavailableError), RPC_FAIL),
    ((ValueError, TypeError), INVALID_PARAMS),  # BadRequestError, bad config values
]


def error_code(exc: BaseException) -> int:
    """The Mooncake ``ErrorCode`` value for a kvpool exception."""
    return next((code for cls, code in _CODES if isinstance(exc, cls)), INTERNAL_ERROR)


def logged(op: str, exc: BaseException) -> int:
    code = error_code(exc)
    expected = code in (OBJECT_NOT_FOUND, OBJECT_HAS_LEASE)
    logger.log(logging.DEBUG if expected else logging.WARNING, "mooncake %s: %d %s", op, code, exc)
    return code


def returns_code(method):
    """Turn any exception of ``method`` into a logged negative error code."""

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        try:
            return method(self, *args, **kwargs)
        except Exception as exc:
            return logged(method.__name__, exc)

    return wrapper


def put_code(result: object) -> int:
    """A batch_put result (None or an exception) as a code; an existing key counts as done
    (Mooncake keeps the first value and answers 0)."""
    if result is None or isinstance(result, errors.AlreadyExistsError):
        return OK
    return result if isinstance(result, int) else error_code(result)  # type: ignore[arg-type]
