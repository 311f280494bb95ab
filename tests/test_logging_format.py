"""`logging.format`: text lines by default, one JSON object per line with
`json`, from a real supervisor and its children."""

from __future__ import annotations

import json
import logging

import pytest

import everystep
from everystep import config as config_file
from everystep import logs
from tests.apps import tracing_workflows as flows
from tests.support.processes import wait_for
from tests.support.supervisor_process import config


def record(message: str, exc_info=None, **extra) -> logging.LogRecord:
    made = logging.LogRecord("everystep", logging.WARNING, __file__, 1, message, (), exc_info)
    made.__dict__.update(extra)
    return made


def test_json_lines_have_the_fields_of_the_text_lines():
    plain = record("run failed: boom", runner="web-0-1", run="0190", workflow="shop.pay", step="shop.charge")
    text = logs.LineFormatter().format(plain)
    entry = json.loads(logs.JsonFormatter().format(plain))
    assert text.split(" ", 1)[1] == "WARNING everystep runner=web-0-1 run=0190 workflow=shop.pay step=shop.charge " \
                                    "run failed: boom"
    assert entry == {"time": text.split(" ", 1)[0], "level": "WARNING", "logger": "everystep", "runner": "web-0-1",
                     "run": "0190", "workflow": "shop.pay", "step": "shop.charge", "message": "run failed: boom"}
    try:
        raise ValueError("bad \udcff input")
    except ValueError as exc:
        line = logs.JsonFormatter().format(record("oops", exc_info=(ValueError, exc, exc.__traceback__)))
    failed = json.loads(line)
    assert failed["exception"].startswith("Traceback") and "ValueError: bad \udcff input" in failed["exception"]
    assert set(failed) == {"time", "level", "logger", "message", "exception"}


def test_the_config_key_takes_text_or_json(tmp_path):
    path = tmp_path / "everystep.yaml"
    path.write_text("logging: {format: json}\n")
    assert config_file.load(path).logging.format == "json"
    path.write_text("{}\n")
    assert config_file.load(path).logging.format == "text"
    path.write_text("logging: {format: logfmt}\n")
    with pytest.raises(config_file.ConfigError, match=r"logging.format: must be one of text, json, got 'logfmt'"):
        config_file.load(path)
    path.write_text("tracing: {enabled: maybe}\n")
    with pytest.raises(config_file.ConfigError, match=r"tracing.enabled: must be true or false"):
        config_file.load(path)
    path.write_text("sentry: {dsn: x}\n")
    with pytest.raises(config_file.ConfigError, match=r"sentry.dsn: unknown key"):
        config_file.load(path)


def test_a_supervisor_logs_json_lines_from_every_process(db, supervisors):
    sup = supervisors(config(db.url, "jsonlogs", imports=["tests.apps.tracing_workflows"], logging={"format": "json"}))
    with db.connect() as conn, everystep.transaction(conn):
        everystep.schedule(flows.fails, "no stock")
    wait_for(lambda: '"run failed: ValueError: no stock"' in sup.output(), timeout=60, what="the failed run's line")
    lines = [json.loads(line) for line in sup.output().splitlines() if line.strip()]
    failed = next(entry for entry in lines if entry["message"] == "run failed: ValueError: no stock")
    assert failed["level"] == "WARNING" and failed["workflow"] == "tests.apps.tracing_workflows.fails"
    assert failed["runner"].startswith("jsonlogs-") and failed["run"]
    assert "Traceback" in failed["exception"] and "ValueError: no stock" in failed["exception"]
    assert any(entry["message"].startswith("supervisor jsonlogs starting") for entry in lines)
