"""`everystep ui` in a subprocess, and a small HTTP client for its API."""

from __future__ import annotations

import http.cookiejar
import json
import os
import re
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

from tests.support.processes import ROOT, wait_for

SERVING = re.compile(r"ui: serving on http://([^ /]+)/")


class UiProcess:
    """`everystep ui --port 0` against a test database; `url` once it serves."""

    def __init__(self, database_url: str, folder: Path, env: dict | None = None, args: tuple = ()):
        folder.mkdir(parents=True, exist_ok=True)
        self.log_path = folder / f"ui-{time.monotonic_ns()}.log"
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "everystep.cli", "--database-url", database_url, "ui", "--port", "0", *args],
            cwd=ROOT, stdout=self.log, stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
        )

    def output(self) -> str:
        return self.log_path.read_text()

    @property
    def url(self) -> str:
        def found():
            if self.proc.poll() is not None:
                raise AssertionError(f"everystep ui exited {self.proc.returncode}: {self.output()}")
            match = SERVING.search(self.output())
            return match and f"http://{match[1]}"
        return wait_for(found, 30, what="everystep ui to serve")

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


class Client:
    """Requests to the UI with a cookie jar, like a browser session."""

    def __init__(self, base: str, token: str | None = None):
        self.base = base
        self.headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.opener = urllib.request.build_opener(urllib.request.HTTPCookieProcessor(http.cookiejar.CookieJar()))

    def request(self, method: str, path: str, body: object = None, headers: dict | None = None,
                form: dict | None = None) -> tuple[int, object]:
        data = None
        all_headers = {**self.headers, **(headers or {})}
        if form is not None:
            data = urllib.parse.urlencode(form).encode()
            all_headers["Content-Type"] = "application/x-www-form-urlencoded"
        elif body is not None:
            data = json.dumps(body).encode()
            all_headers["Content-Type"] = "application/json"
        request = urllib.request.Request(self.base + path, data=data, method=method, headers=all_headers)
        try:
            with self.opener.open(request, timeout=20) as response:
                status, text = response.status, response.read().decode()
        except urllib.error.HTTPError as error:
            status, text = error.code, error.read().decode()
        try:
            return status, json.loads(text)
        except ValueError:
            return status, text

    def get(self, path: str) -> tuple[int, object]:
        return self.request("GET", path)

    def csrf(self) -> str:
        status, page = self.get("/")
        assert status == 200, page
        return re.search(r'name="everystep-csrf-token" content="([0-9a-f]+)"', page)[1]
