"""An HTTP server whose every ranged GET waits a fixed delay first: an object store's
latency for bench/storage.py's HTTP rows (127.0.0.1 only, the files it is given only).

    python bench/httpdelay.py PORT_FILE DELAY_S NAME=PATH [NAME=PATH ...]

It writes the port it listens on to PORT_FILE once it accepts, and serves /NAME as the
file PATH: HEAD (size, byte ranges accepted) and GET with one `Range: bytes=A-B`, over
HTTP/1.1 keep-alive, one thread per connection.
"""

from __future__ import annotations

import http.server
import os
import re
import sys
import time


class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # headers and body are two sends: no 40 ms stall

    def log_message(self, *args) -> None:
        """Quiet."""

    def _file(self):
        path = self.server.files.get(self.path.lstrip("/"))
        if path is None:
            self.send_error(404)
        return path

    def _head(self, status: int, length: int, size: int, first: int = 0) -> None:
        self.send_response(status)
        self.send_header("Accept-Ranges", "bytes")
        self.send_header("Content-Length", str(length))
        if status == 206:
            self.send_header("Content-Range", f"bytes {first}-{first + length - 1}/{size}")
        self.end_headers()

    def do_HEAD(self) -> None:
        path = self._file()
        if path is not None:
            size = os.path.getsize(path)
            self._head(200, size, size)

    def do_GET(self) -> None:
        path = self._file()
        if path is None:
            return
        size = os.path.getsize(path)
        match = re.fullmatch(r"bytes=(\d+)-(\d+)", self.headers.get("Range", ""))
        if match is None:
            self.send_error(416)
            return
        first, last = int(match[1]), min(int(match[2]), size - 1)
        time.sleep(self.server.delay)
        with open(path, "rb") as f:
            f.seek(first)
            body = f.read(last - first + 1)
        self._head(206, len(body), size, first)
        self.wfile.write(body)


def main(argv: list[str]) -> int:
    port_file, delay = argv[1], float(argv[2])
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    server.delay = delay
    server.files = dict(pair.split("=", 1) for pair in argv[3:])
    with open(port_file + ".tmp", "w") as f:
        f.write(str(server.server_address[1]))
    os.rename(port_file + ".tmp", port_file)
    server.serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
