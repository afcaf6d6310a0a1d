"""Arguments of the master's RPC methods, checked where they arrive: anything malformed is a
``BadRequestError`` (a 400 with a message), never an internal error in the state below."""

from __future__ import annotations

from kvpool.common.errors import BadRequestError, ForbiddenError
from kvpool.common.rpc import current_call
from kvpool.store.master.objects import PutOptions, Tier


def int_arg(value: object, name: str) -> int:
    """An integer argument from the wire (bad input is a 400, never an internal error)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadRequestError(f"{name} must be an integer, got {type(value).__name__}")
    return value


def tier_arg(value: object) -> Tier:
    try:
        return Tier(value)
    except ValueError as exc:
        raise BadRequestError(f"tier must be one of {[t.value for t in Tier]}") from exc


def str_arg(value: object) -> str:
    if value is not None and not isinstance(value, str):
        raise BadRequestError("expected a string")
    return value or ""


def options_arg(value: object) -> PutOptions:
    try:
        return PutOptions.from_wire(value)
    except ValueError as exc:
        raise BadRequestError(str(exc), param="options") from None


def check_force(force: object) -> None:
    if force and current_call().role != "admin":
        raise ForbiddenError("a forced remove is an admin call: connect with the admin token "
                             "(KVPOOL_ADMIN_TOKEN)")  # fmt: skip


def items_arg(value: object, width: int, what: str) -> list[list]:
    """A batch argument: a list of ``width``-element lists (anything else is a 400)."""
    if not isinstance(value, list) or not all(
        isinstance(i, list) and len(i) == width for i in value
    ):
        raise BadRequestError(f"items must be a list of [{what}]")
    return value


def keys_arg(value: object) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(k, str) for k in value):
        raise BadRequestError("keys must be a list of strings")
    return value
