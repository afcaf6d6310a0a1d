"""Cluster authentication: one shared token, keys derived from it per use, and the proofs of
the challenge-response handshakes (docs/operations.md, "Security").

Every kvpool process of a cluster holds the same secret, the *cluster token*: from an explicit
argument, a token file (``--auth-token-file``, which must not be readable by group or others),
``$KVPOOL_AUTH_TOKEN_FILE`` or ``$KVPOOL_AUTH_TOKEN``. The token itself never crosses the
network: each use gets its own key derived from it (HMAC-SHA256 with a purpose label), and the
RPC and transfer handshakes prove knowledge of their key with an HMAC over two fresh nonces,
in both directions, so a client also refuses a server that cannot prove it holds the token.

An optional, separate *admin token* unlocks admin calls (a forced remove from the pool).
Without a cluster token a process runs *open*: no authentication at all, which kvpool allows
only on loopback addresses.
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import os
import secrets
import stat

from kvpool.common.errors import AuthError

AUTH_ENV = "KVPOOL_AUTH_TOKEN"
AUTH_FILE_ENV = "KVPOOL_AUTH_TOKEN_FILE"
ADMIN_ENV = "KVPOOL_ADMIN_TOKEN"
ADMIN_FILE_ENV = "KVPOOL_ADMIN_TOKEN_FILE"
API_KEY_ENV = "KVPOOL_API_KEY"

MAX_TOKEN_FILE_BYTES = 4096
NONCE_BYTES = 16
PROOF_BYTES = 32

# purposes of derived keys: one per mechanism, so that a key seen by one cannot serve another
RPC = b"rpc"
TRANSFER = b"transfer"
HTTP = b"http"  # bearer of internal HTTP calls (conductor -> worker, segment directory)
KV_MAC = b"kv-mac"  # keyed checksum of pool objects

__all__ = [
    "ADMIN_ENV",
    "ADMIN_FILE_ENV",
    "API_KEY_ENV",
    "AUTH_ENV",
    "AUTH_FILE_ENV",
    "AuthError",
    "add_token_args",
    "admin_token",
    "api_key",
    "cluster_token",
    "derive_key",
    "export_cli_tokens",
    "internal_bearer",
    "new_nonce",
    "proof",
    "proofs_match",
    "read_token_file",
]


def read_token_file(path: str) -> str:
    """The token in ``path``: a file of this user, not readable or writable by group or others
    (``chmod 600``), whose first line is the token."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError as exc:
        raise ValueError(f"cannot open token file {path}: {exc.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ValueError(f"token file {path} is not a regular file")
        if st.st_mode & 0o077:
            raise ValueError(
                f"token file {path} is accessible by group or others "
                f"(mode {stat.S_IMODE(st.st_mode):o}); run: chmod 600 {path}"
            )
        if st.st_uid != os.geteuid():
            raise ValueError(f"token file {path} belongs to another user")
        data = os.read(fd, MAX_TOKEN_FILE_BYTES + 1)
    finally:
        os.close(fd)
    if len(data) > MAX_TOKEN_FILE_BYTES:
        raise ValueError(f"token file {path} is over {MAX_TOKEN_FILE_BYTES} bytes")
    lines = data.decode("utf-8", errors="strict").strip().splitlines()
    token = lines[0].strip() if lines else ""
    if not token:
        raise ValueError(f"token file {path} is empty")
    return token


def _from(explicit: str | None, file: str | None, file_env: str, env: str) -> str | None:
    if explicit is not None:
        return explicit or None  # "" means: explicitly none
    path = file or os.environ.get(file_env)
    if path:
        return read_token_file(path)
    return os.environ.get(env) or None


def cluster_token(explicit: str | None = None, file: str | None = None) -> str | None:
    """The cluster token: ``explicit`` (``""``: none), else ``file``, else
    ``$KVPOOL_AUTH_TOKEN_FILE``, else ``$KVPOOL_AUTH_TOKEN``; None when there is none."""
    return _from(explicit, file, AUTH_FILE_ENV, AUTH_ENV)


def admin_token(explicit: str | None = None, file: str | None = None) -> str | None:
    """The admin token, found like the cluster token (``KVPOOL_ADMIN_TOKEN[_FILE]``)."""
    return _from(explicit, file, ADMIN_FILE_ENV, ADMIN_ENV)


def api_key(explicit: str | None = None) -> str | None:
    """The key OpenAI clients present to the conductor (``Authorization: Bearer``):
    ``$KVPOOL_API_KEY`` if set (keep the cluster token among the cluster's processes), else the
    cluster token itself."""
    if explicit is not None:
        return explicit or None
    return os.environ.get(API_KEY_ENV) or cluster_token()


def add_token_args(p: argparse.ArgumentParser, admin: bool = False) -> None:
    """``--auth-token-file`` (and ``--admin-token-file``) for a subcommand."""
    p.add_argument("--auth-token-file", metavar="FILE", default=None,
                   help=f"the cluster token, in a file only you can read (chmod 600); default "
                        f"${AUTH_FILE_ENV}, else ${AUTH_ENV}; none: loopback only")  # fmt: skip
    if admin:
        p.add_argument("--admin-token-file", metavar="FILE", default=None,
                       help=f"the admin token (forced removes); default ${ADMIN_FILE_ENV}, "
                            f"else ${ADMIN_ENV}; none: admin calls are refused")  # fmt: skip


def export_cli_tokens(args: argparse.Namespace) -> None:
    """Check the token files given on the command line (or in the environment) and hand them
    to everything this process and its children start, through the environment; a problem
    raises ``ValueError`` with what to fix."""
    for attr, env in (("auth_token_file", AUTH_FILE_ENV), ("admin_token_file", ADMIN_FILE_ENV)):
        path = getattr(args, attr, None) or os.environ.get(env)
        if path:
            read_token_file(path)
            os.environ[env] = os.path.abspath(path)


def derive_key(token: str, purpose: bytes) -> bytes:
    """The 32-byte key of one purpose (``RPC``, ``TRANSFER``, ``HTTP``, ``KV_MAC``)."""
    return hmac.new(token.encode(), b"kvpool/v1/" + purpose, hashlib.sha256).digest()


def internal_bearer(token: str) -> str:
    """The bearer token of kvpool's internal HTTP calls (not the cluster token itself, which
    never crosses the network)."""
    return "kvp1." + derive_key(token, HTTP).hex()


def new_nonce() -> bytes:
    return secrets.token_bytes(NONCE_BYTES)


def proof(key: bytes, label: bytes, first: bytes, second: bytes) -> bytes:
    """HMAC-SHA256 over a role label and two nonces (the prover's peer's nonce first)."""
    return hmac.new(key, label + b"|" + first + b"|" + second, hashlib.sha256).digest()


def proofs_match(given: object, expected: bytes) -> bool:
    """Constant-time comparison; anything but bytes of the right length is a mismatch."""
    return isinstance(given, bytes) and hmac.compare_digest(given, expected)
