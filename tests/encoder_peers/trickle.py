"""An allow-listed image host that never finishes: one byte every half second, for ever
(a slow-URL flood's target; tests/test_hostile_flood.py and bench/flood.py).

    url, stop = start_trickle()   # http://127.0.0.1:<port>/slow.png
"""

from __future__ import annotations

import http.server
import threading
import time
from collections.abc import Callable


class _Trickle(http.server.BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802
        self.send_response(200)
        self.send_header("Content-Length", "1000000")
        self.end_headers()
        try:
            while True:
                self.wfile.write(b"\x89")
                self.wfile.flush()
                time.sleep(0.5)
        except OSError:  # the fetcher gave up: expected
            pass

    def log_message(self, *a):
        pass


class _Server(http.server.ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request, client_address):
        pass


def start_trickle() -> tuple[str, Callable[[], None]]:
    srv = _Server(("127.0.0.1", 0), _Trickle)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return f"http://127.0.0.1:{srv.server_address[1]}/slow.png", srv.shutdown
