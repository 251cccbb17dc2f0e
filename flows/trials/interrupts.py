"""Ctrl-C in a sweep, said once: the interrupted trial's stop line and one SweepInterrupted naming the command that
continues the study — none of the tracebacks Optuna and Prefect log about a KeyboardInterrupt under it.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager


class SweepInterrupted(KeyboardInterrupt):
    """Ctrl-C or SIGTERM stopped the sweep; what to run to continue it."""


class _NoInterruptReports(logging.Filter):
    """Drops what Optuna and Prefect log about a KeyboardInterrupt (the sweep says it in one line): Optuna's 'Trial N
    failed with parameters … because of the following error' with its traceback and the 'failed with value None' after
    it, and Prefect's 'Crash detected! Execution was aborted by an interrupt signal.'"""

    def __init__(self):
        super().__init__()
        self.interrupted: set[str] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if record.exc_info and isinstance(record.exc_info[1], KeyboardInterrupt):
            self.interrupted.add(message.split(" failed with parameters")[0])  # 'Trial 3'
            return False
        if message.endswith("failed with value None.") and message.split(" failed with value")[0] in self.interrupted:
            return False
        return not (message.startswith("Crash detected!") and "interrupt" in message)


@contextmanager
def interrupts_said_once(command: str):
    """Around a sweep command: a Ctrl-C (or SIGTERM) leaves the terminal with the interrupted trial's stop line and
    one SweepInterrupted naming `command` to continue the study — no tracebacks from the libraries under it."""
    quiet = _NoInterruptReports()
    loggers = [logging.getLogger(name) for name in ("optuna.study._optimize", "prefect.flow_runs", "prefect.task_runs")]
    for logger in loggers:
        logger.addFilter(quiet)
    try:
        yield
    except KeyboardInterrupt as e:
        raise SweepInterrupted(f"sweep interrupted; its finished trials are kept — continue it with: {command}") from e
    finally:
        for logger in loggers:
            logger.removeFilter(quiet)
