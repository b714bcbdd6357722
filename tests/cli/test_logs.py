"""The JSON log format: one object per line with time, level, logger, message and the exception."""

import json
import logging
import sys

from specdec.cli.logs import JsonFormatter


def test_a_record_is_one_json_object_per_line():
    logger = logging.getLogger("specdec.test")
    try:
        raise ValueError("bad\nvalue")
    except ValueError:
        record = logger.makeRecord(
            "specdec.test", logging.ERROR, __file__, 1, "step %d failed", (7,), exc_info=sys.exc_info()
        )
    line = JsonFormatter().format(record)
    assert "\n" not in line  # the traceback's newlines are escaped
    entry = json.loads(line)
    assert entry["level"] == "ERROR" and entry["logger"] == "specdec.test" and entry["message"] == "step 7 failed"
    assert entry["time"].endswith("+00:00") and "ValueError: bad" in entry["exception"]
    plain = json.loads(JsonFormatter().format(logger.makeRecord("x", logging.INFO, __file__, 1, "hi", (), None)))
    assert set(plain) == {"time", "level", "logger", "message"}
