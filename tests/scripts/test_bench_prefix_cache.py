"""bench_prefix_cache against a stdlib SSE server on loopback: TTFT is the first chunk,
cached tokens come from the usage chunk, non-loopback URLs are refused."""

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from scripts.serving import bench_prefix_cache as bench


class _Handler(BaseHTTPRequestHandler):
    seen: list[list[int]] = []

    def do_POST(self):  # noqa: N802 (http.server's name)
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        cached = 992 if body["prompt"] in self.seen else 0
        self.seen.append(body["prompt"])
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        chunks = [
            {"choices": [{"text": "x"}]},
            {"choices": [], "usage": {"prompt_tokens_details": {"cached_tokens": cached}}},
        ]
        for chunk in chunks:
            self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
        self.wfile.write(b"data: [DONE]\n\n")

    def log_message(self, *args):
        pass


def test_bench_reports_first_and_repeated_ttft():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        out = bench.main(
            ["--base-url", url, "--model", "m", "--prompt-tokens", "1000", "--repeats", "3", "--seed", "1"]
        )
    finally:
        server.shutdown()
    assert out["prompt_tokens"] == 1000 and len(out["ttft_repeat_ms"]) == 3
    assert out["ttft_first_ms"] > 0 and out["ratio_first_over_repeat"] > 0
    assert out["cached_tokens_first"] == 0 and out["cached_tokens_repeat"] == [992, 992, 992]
    assert len(_Handler.seen[0]) == 1000 and all(0 < t < 1000 for t in _Handler.seen[0])


def test_bench_refuses_non_loopback_urls():
    with pytest.raises(ValueError, match="loopback"):
        bench.loopback_target("http://10.0.0.5:8000")
    assert bench.loopback_target("http://localhost:9000/") == ("localhost", 9000, "")
