"""TCP transport (client side): striped, pipelined, coalesced frames to a peer's server.

Per peer a small pool of connections (``tcp_conn.Connection``), opened on demand and reused.
A request larger than ``slice_bytes`` becomes several frames striped over the pool; the small
requests of a batch stay together on one connection and travel as one frame train (one
``sendmsg``). A broken connection fails what it carried and the next submit dials again.
"""

from __future__ import annotations

import itertools
import logging
import socket
import threading
import time

from kvpool.common import auth
from kvpool.common.errors import AuthError, KVPoolError, KVPoolTimeoutError, TransferError
from kvpool.transfer import protocol as P
from kvpool.transfer.request import BatchHandle, PendingOp, State
from kvpool.transfer.segment import SegmentDescriptor
from kvpool.transfer.transports.base import Transport, TransportContext, register_transport
from kvpool.transfer.transports.tcp_conn import Connection, Frame, stall_checks

logger = logging.getLogger(__name__)

CHUNK_FRAMES = 32  # frames per enqueue: the peer starts answering while the rest is packed


@register_transport("tcp")
class TcpTransport(Transport):
    def __init__(self, ctx: TransportContext) -> None:
        super().__init__(ctx)
        self._pools: dict[tuple[str, int], list[Connection]] = {}
        self._lock = threading.Lock()
        self._rr = itertools.count()

    def can_reach(self, desc: SegmentDescriptor) -> bool:
        return desc.port > 0

    def submit(self, ops: list[PendingOp]) -> None:
        frames = self._slice(ops)
        peer = (ops[0].desc.host, ops[0].desc.port)
        budget = min(op.deadline for op in ops) - time.monotonic()
        sliced = len(frames) - len(ops)  # > 0 when large requests were cut into frames
        want = min(self.ctx.config.num_streams, max(1, sliced + 1))
        try:
            conns = self._connections(peer, want, budget)
        except (OSError, TransferError, AuthError) as exc:
            self.ctx.stats.error("auth" if isinstance(exc, AuthError) else "connect")
            err: KVPoolError = TransferError(
                f"cannot reach transfer peer {peer[0]}:{peer[1]}: {exc or type(exc).__name__}"
            )
            if isinstance(exc, TimeoutError):
                err = KVPoolTimeoutError(f"connecting to {peer[0]}:{peer[1]} timed out")
            for op in ops:
                op.fail(err)
            return
        # Frames of large (sliced) requests are striped over the connections; whole small
        # requests stay together on one connection, so they travel as one train.
        per_conn: list[list[Frame]] = [[] for _ in conns]
        start = next(self._rr)
        home = start % len(conns)
        for i, frame in enumerate(frames):
            k = (start + i) % len(conns) if frame.length < frame.op.length else home
            per_conn[k].append(frame)
            if not frame.op.conns or frame.op.conns[-1] is not conns[k]:
                frame.op.conns.append(conns[k])
        # A synchronous caller reads its own replies (drive) when they all use one connection.
        sync = ops[0].sync and sum(1 for g in per_conn if g) == 1
        for a in range(0, max(map(len, per_conn)), CHUNK_FRAMES):
            for conn, group in zip(conns, per_conn, strict=True):
                part = group[a : a + CHUNK_FRAMES]
                if part and not conn.enqueue(part, sync):
                    err = TransferError(f"connection to {conn.peer} lost: {conn.reason}")
                    for frame in part:
                        frame.op.frame_done(0, err)

    def exchange(self, op: P.Op, items: list[tuple], deadline: float) -> list | None:
        """Over an idle connection to the peer, held by this thread for one train out and its
        replies in (see ``Transport.exchange``); None when every connection is busy, none is
        open yet, or a request would have to be sliced."""
        step = self.ctx.config.slice_bytes
        if any(len(local) > step for _, local, _, _ in items):
            return None
        desc = items[0][2]
        for conn in self._pools.get((desc.host, desc.port), ()):
            if conn.claim():
                return conn.exchange(op, items, deadline)
        return None

    def drive(self, handle: BatchHandle) -> None:
        """Receive this batch's replies in the calling thread, connection by connection (a
        batch to several peers has one synchronous train on each), each until the requests
        it carries are finished."""
        by_conn: dict[int, tuple[Connection, list[PendingOp]]] = {}
        for op in handle._ops:
            for c in op.conns:
                by_conn.setdefault(id(c), (c, []))[1].append(op)
        for conn, ops in by_conn.values():
            conn.drive(handle, lambda ops=ops: all(op.state is not State.PENDING for op in ops))

    def cancel(self, op: PendingOp) -> None:
        op.timed_out = True
        for conn in list(op.conns):
            conn.abort("a request on this connection timed out")

    def forget(self, desc: SegmentDescriptor) -> None:
        with self._lock:
            conns = self._pools.pop((desc.host, desc.port), [])
        for conn in conns:
            conn.abort("peer forgotten")

    def close(self) -> None:
        with self._lock:
            pools, self._pools = list(self._pools.values()), {}
        for conns in pools:
            for conn in conns:
                conn.abort("transfer engine closed")

    def _slice(self, ops: list[PendingOp]) -> list[Frame]:
        step = int(self.ctx.config.slice_bytes)
        frames: list[Frame] = []
        for op in ops:
            op.transport = self.name
            if op.length <= step:  # the common case: one frame, no slicing
                frames.append(Frame(op, op.local, op.remote_offset))
                continue
            n = -(-op.length // step)
            op.set_frames(n)
            for k in range(n):
                a = k * step
                frames.append(Frame(op, op.local[a : a + step], op.remote_offset + a))
        return frames

    def _connections(self, peer: tuple[str, int], want: int, budget: float) -> list[Connection]:
        """``want`` live connections to ``peer`` (dialing within ``budget`` seconds; with one
        live connection, a failed extra dial just means less striping)."""
        with self._lock:
            conns = [c for c in self._pools.get(peer, []) if not c.dead]
            self._pools[peer] = conns
            missing = want - len(conns)
        fresh = []
        timeout = max(0.01, min(self.ctx.config.connect_timeout, budget))
        for _ in range(max(0, missing)):
            try:
                fresh.append(self._dial(peer, timeout))
            except (OSError, TransferError, AuthError):
                if not conns and not fresh:
                    raise
                logger.info("transfer: extra connection to %s:%s failed; striping less", *peer)
                break
        with self._lock:
            conns = self._pools.setdefault(peer, [])
            conns.extend(fresh)
            live = [c for c in conns if not c.dead]
        if not live:
            raise TransferError("no live connection")
        return live[: max(want, 1)]

    def _dial(self, peer: tuple[str, int], timeout: float) -> Connection:
        cfg = self.ctx.config
        sock = socket.create_connection(peer, timeout=timeout)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._handshake(sock, f"{peer[0]}:{peer[1]}", time.monotonic() + max(timeout, 1.0))
            sock.settimeout(None)
            stall_checks(sock)
        except BaseException:
            sock.close()
            raise
        return Connection(sock, f"{peer[0]}:{peer[1]}", int(cfg.tcp_inline_bytes),
                          cfg.spin_us * 1e-6)  # fmt: skip

    def _handshake(self, sock: socket.socket, where: str, deadline: float) -> None:
        """The client side of the challenge-response (see ``protocol``): prove the token,
        and send nothing to a server that cannot prove it in return."""
        token = self.ctx.config.auth_token
        key = auth.derive_key(token, auth.TRANSFER) if token else None
        nonce = auth.new_nonce()
        sock.sendall(P.HELLO.pack(P.MAGIC, P.VERSION, 0, nonce))
        magic, status, wants_proof, server_nonce, server_proof = P.CHALLENGE.unpack(
            P.recv_before(sock, P.CHALLENGE.size, deadline)
        )
        if magic != P.MAGIC:
            raise TransferError(f"{where} is not a kvpool transfer server")
        if status != P.Status.OK:
            text = P.STATUS_TEXT.get(status, str(status))  # type: ignore[call-overload]
            raise TransferError(f"{where} refused the handshake: {text}")
        if key is not None and not (
            wants_proof and auth.proofs_match(server_proof,
                                              auth.proof(key, b"server", nonce, server_nonce))
        ):  # fmt: skip
            raise AuthError(f"transfer peer {where} could not prove it holds the cluster token "
                            f"({'wrong token' if wants_proof else 'it runs without one'})")  # fmt: skip
        mine = P.NO_PROOF if key is None else auth.proof(key, b"client", server_nonce, nonce)
        sock.sendall(P.PROOF.pack(mine))
        magic, status = P.WELCOME.unpack(P.recv_before(sock, P.WELCOME.size, deadline))
        if magic != P.MAGIC or status != P.Status.OK:
            text = P.STATUS_TEXT.get(status, str(status))  # type: ignore[call-overload]
            raise TransferError(f"{where} refused the handshake: {text}")
