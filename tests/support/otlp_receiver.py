"""An OTLP/HTTP traces endpoint for tests and benchmarks: decodes each export
request with opentelemetry-proto and keeps its spans."""

from __future__ import annotations

import gzip
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest


class Receiver:
    """An OTLP/HTTP traces endpoint on a free port that decodes each request
    (opentelemetry-proto) and keeps its spans as (resource attributes, span).
    With `decode=False` (benchmarks) it only reads and acknowledges them: a
    collector runs elsewhere, not on the CPU the workers use."""

    def __init__(self, decode: bool = True):
        self.spans: list = []
        self.requests = 0
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802
                body = self.rfile.read(int(self.headers["Content-Length"]))
                receiver.requests += 1
                if decode:
                    if self.headers.get("Content-Encoding") == "gzip":
                        body = gzip.decompress(body)
                    request = ExportTraceServiceRequest()
                    request.ParseFromString(body)
                    for resource_spans in request.resource_spans:
                        service = {a.key: a.value.string_value for a in resource_spans.resource.attributes}
                        for scope_spans in resource_spans.scope_spans:
                            receiver.spans += [(service, span) for span in scope_spans.spans]
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.end_headers()

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
