"""Helpers for the model-source tests: S3 uploads, and a TCP relay that makes the network slow or broken without
touching the code under test."""
from __future__ import annotations

import socket
import threading
import time
from pathlib import Path


def upload_folder(client, folder: Path, bucket: str, prefix: str) -> None:
    for path in sorted(folder.rglob("*")):
        if path.is_file():
            client.upload_file(str(path), bucket, f"{prefix}/{path.relative_to(folder).as_posix()}")


class TcpProxy:
    """Relays 127.0.0.1:`port` to 127.0.0.1:`upstream_port`. Responses can be slowed to `bytes_per_s` per
    connection, or cut: after `cut_after` response bytes every open connection is dropped and new ones are closed
    at once, as a network that goes away does. `heal()` makes it relay normally again; `close()` stops it."""

    def __init__(self, upstream_port: int, *, bytes_per_s: float | None = None, cut_after: int | None = None):
        self.upstream_port = upstream_port
        self.bytes_per_s = bytes_per_s
        self.cut_after = cut_after
        self.relayed = 0
        self.cut = False
        self._lock = threading.Lock()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        threading.Thread(target=self._accept, daemon=True).start()

    def heal(self) -> None:
        with self._lock:
            self.cut, self.cut_after, self.bytes_per_s = False, None, None

    def close(self) -> None:
        self._listener.close()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            if self.cut:
                client.close()
                continue
            upstream = socket.create_connection(("127.0.0.1", self.upstream_port))
            threading.Thread(target=self._pipe, args=(client, upstream, False), daemon=True).start()
            threading.Thread(target=self._pipe, args=(upstream, client, True), daemon=True).start()

    def _pipe(self, source: socket.socket, sink: socket.socket, is_response: bool) -> None:
        try:
            while data := source.recv(64 * 1024):
                if is_response:
                    with self._lock:
                        self.relayed += len(data)
                        if self.cut_after is not None and self.relayed > self.cut_after:
                            self.cut = True
                    rate = self.bytes_per_s
                    if rate:
                        time.sleep(len(data) / rate)
                if self.cut:
                    break
                sink.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (source, sink):
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                sock.close()
