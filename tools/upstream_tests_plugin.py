# Copyright (c) the DeepSpeed ZeRO-3 fork authors.
# SPDX-License-Identifier: Apache-2.0
"""pytest plugin that tools/upstream_tests.py loads into each run of an upstream test file (-p).

It logs each test's start and reports to a JSON-lines file as they happen, rather than relying on junit xml
at exit: a hung test is ended by pytest-timeout's thread method, which kills the whole pytest process, so the
results of the tests before it would be lost, and the runner needs to know which test was running to skip it
on the rerun of the rest of the file.

After each test it unlinks the /dev/shm segments of DeepSpeed's CPU shm allreduce that this run created:
pristine 0.19.8 never unlinks them (66 MiB per rank), and a segment left under the same name (the names
reuse the port) would be reopened with stale contents by the next test.
"""

import json
import os
import time
from pathlib import Path

LOG = os.environ.get("UPSTREAM_TESTS_LOG")
_START = time.time()


def _log(record):
    if LOG:
        with open(LOG, "a") as f:
            f.write(json.dumps(record) + "\n")


def pytest_runtest_logstart(nodeid, location):
    _log({"nodeid": nodeid, "event": "start"})


def pytest_runtest_logreport(report):
    detail = ""
    if report.failed:
        # The last lines hold the assertion or the exception; enough to tell version skew from a fork defect.
        detail = "\n".join(str(report.longrepr).splitlines()[-15:])
    elif report.skipped and isinstance(report.longrepr, tuple):
        detail = str(report.longrepr[2])
    _log({
        "nodeid": report.nodeid,
        "event": report.when,
        "outcome": report.outcome,
        "duration": round(report.duration, 1),
        "detail": detail
    })


def pytest_runtest_logfinish(nodeid, location):
    for path in Path("/dev/shm").glob("deepspeed_*_127.0.0.1_*"):
        try:
            if path.stat().st_mtime >= _START:
                path.unlink()
        except FileNotFoundError:
            pass
    _log({"nodeid": nodeid, "event": "finish"})
