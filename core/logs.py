"""Log routing: datatrove logs through loguru; inside a Prefect run its messages go to the run's logger."""

from __future__ import annotations

import logging
import os

from loguru import logger as loguru_logger
from prefect.context import FlowRunContext, TaskRunContext
from prefect.exceptions import MissingContextError
from prefect.logging import get_run_logger
from prefect.logging.handlers import APILogHandler

_ROUTED = False


def _sink(message) -> None:
    record = message.record
    try:
        logger = get_run_logger()
    except MissingContextError:
        logger = logging.getLogger("datatrove")
    logger.log(record["level"].no, "%s", record["message"])


def route_loguru(level: str = "INFO") -> None:
    """Replace loguru's stderr sink with one that writes to the current Prefect run (or `logging`).

    Idempotent.
    """
    global _ROUTED
    if _ROUTED:
        return
    loguru_logger.remove()
    loguru_logger.add(_sink, level=level, format="{message}")
    _ROUTED = True


class InRuns(APILogHandler):
    """Prefect's API handler, silent outside a flow or task run (a later `moeflow explain`, say)."""

    def emit(self, record: logging.LogRecord) -> None:
        if FlowRunContext.get() is not None or TaskRunContext.get() is not None:
            super().emit(record)


EXTRA = "PREFECT_LOGGING_EXTRA_LOGGERS"


def route_moeflow_logs() -> None:
    """moeflow's warnings (a training alarm, quarantined input) into the Prefect run's log, shown in the UI
    as they happen: here, and in the processes this one starts (which read the setting when they start)."""
    names = [n.strip() for n in os.environ.get(EXTRA, "").split(",") if n.strip()]
    if "moeflow" not in names:
        os.environ[EXTRA] = ",".join([*names, "moeflow"])
    logger = logging.getLogger("moeflow")
    if not any(isinstance(h, APILogHandler) for h in logger.handlers):
        logger.addHandler(InRuns())
