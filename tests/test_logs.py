"""The one log schema (csi_pmem.logs): the driver's RPC records and the sidecar's events
come out with the same keys, in JSON and in text."""

from __future__ import annotations

import json
import logging
import re
import sys

from csi_pmem import logs

TS = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z")


def _record(msg: str, extra: dict | None = None, exc: bool = False) -> logging.LogRecord:
    exc_info = None
    if exc:
        try:
            raise ValueError("boom")
        except ValueError:
            exc_info = sys.exc_info()
    record = logging.getLogger("csi_pmem.test").makeRecord(
        "csi_pmem.test", logging.WARNING, __file__, 1, msg, (), exc_info, extra=extra)
    record.created = 1700000000.25
    record.msecs = 250.0
    return record


def test_driver_and_sidecar_records_share_the_json_keys():
    rpc = json.loads(logs.JsonFormatter().format(_record(
        "CreateVolume -> OK", {"rpc": "CreateVolume", "code": "OK", "seconds": 0.5,
                               "request": {"name": "v"}})))
    event = json.loads(logs.JsonFormatter().format(_record(
        "listening", {"fields": {"port": 8081, "name": "not a LogRecord attribute here"}})))
    for doc in (rpc, event):
        assert list(doc)[:4] == ["ts", "level", "logger", "msg"], doc
        assert doc["ts"] == "2023-11-14T22:13:20.250Z" and TS.fullmatch(doc["ts"])
        assert doc["level"] == "warning" and doc["logger"] == "csi_pmem.test"
        assert "fields" not in doc and "exc" not in doc
    assert rpc["rpc"] == "CreateVolume" and rpc["request"] == {"name": "v"}
    assert event["port"] == 8081 and event["name"] == "not a LogRecord attribute here"


def test_a_traceback_is_exc_in_json_and_follows_the_fields_in_text():
    doc = json.loads(logs.JsonFormatter().format(_record("failed", exc=True)))
    assert "ValueError: boom" in doc["exc"] and "exception" not in doc
    text = logs.TextFormatter().format(_record("failed", {"fields": {"state": "x"}}, exc=True))
    first, _, rest = text.partition("\n")
    assert first.endswith("WARNING csi_pmem.test: failed state=x"), first
    assert rest.startswith("Traceback") and "ValueError: boom" in rest


def test_text_shows_the_request_as_json():
    text = logs.TextFormatter().format(_record("CreateVolume -> OK",
                                               {"rpc": "CreateVolume", "request": {"a": 1}}))
    assert text.endswith('csi_pmem.test: CreateVolume -> OK request={"a": 1}'), text
    assert isinstance(logs.formatter("json"), logs.JsonFormatter)
    assert isinstance(logs.formatter("text"), logs.TextFormatter)
