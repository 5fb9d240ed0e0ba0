"""Log routing: datatrove logs through loguru; inside a Prefect run its messages go to the run's logger."""

from __future__ import annotations

import logging

_ROUTED = False


def _sink(message) -> None:
    from prefect.exceptions import MissingContextError
    from prefect.logging import get_run_logger

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
    from loguru import logger

    logger.remove()
    logger.add(_sink, level=level, format="{message}")
    _ROUTED = True
