"""ZeroMQ CURVE on TCP sockets that cross machines: encrypted, and only the holder of our client key connects.

The executor's sockets are private files (ipc://) while its workers share its machine. Workers placed on
other nodes (the Ray backend) connect over TCP instead, where anyone on the network could reach a bound
socket: a PUSH socket would hand them steps, a PULL socket would take forged replies. CURVE (libzmq's, with
pyzmq's ZAP authenticator) closes both: the bound side is a CURVE server that admits one client public key,
and the keys reach the workers through the launcher's own channel, never the network socket itself.
"""
from __future__ import annotations

import hmac

import msgspec
import zmq
import zmq.auth.thread


class CurveClientKeys(msgspec.Struct, frozen=True):
    """What a connecting peer needs (z85 text): the server's public key and its own key pair."""
    server_public: str
    client_public: str
    client_secret: str

    def secure(self, sock: zmq.Socket) -> None:
        """Set on a connecting socket before connect()."""
        sock.curve_serverkey = self.server_public.encode()
        sock.curve_publickey = self.client_public.encode()
        sock.curve_secretkey = self.client_secret.encode()


class _OneClient:
    """ZAP credentials provider: admits exactly one client public key."""

    def __init__(self, client_public: bytes) -> None:
        self._client_public = client_public

    def callback(self, domain: str, key: bytes) -> bool:
        return hmac.compare_digest(key, self._client_public)     # pyzmq passes the z85 text of the key


class CurveServer:
    """The bound side: a fresh key pair per engine, a ZAP authenticator on the given context."""

    def __init__(self, ctx: zmq.Context) -> None:
        if not zmq.has("curve"):
            raise RuntimeError("this libzmq has no CURVE support; workers on other nodes need it (install "
                               "pyzmq's own wheel, which bundles libsodium)")
        server_public, self._server_secret = zmq.curve_keypair()
        client_public, client_secret = zmq.curve_keypair()
        self.client_keys = CurveClientKeys(server_public.decode(), client_public.decode(), client_secret.decode())
        self._auth = zmq.auth.thread.ThreadAuthenticator(ctx)
        self._auth.start()
        self._auth.configure_curve_callback("*", credentials_provider=_OneClient(client_public))

    def secure(self, sock: zmq.Socket) -> None:
        """Set on a bound socket before bind()."""
        sock.curve_server = True
        sock.curve_secretkey = self._server_secret

    def close(self) -> None:
        self._auth.stop()
