"""A signal said once: the stopped run's (or sweep's) one line naming the command that continues it — none of the
tracebacks and crash errors Optuna and Prefect log about a KeyboardInterrupt or a TerminationSignal under it. Bad
input said once too: the command's one `error:` line, not Prefect's tracebacks of the task and flow it went through.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager

from flows.errors import input_error

PREFECT_LOGGERS = ("prefect.flow_runs", "prefect.task_runs")
# a flow or task engine logs on its own logger, 'prefect.engine', until its run's logger is set, and a signal can land
# then: 'Crash detected! ...' got through from there once in a CI run (tests/test_signals.py, SIGTERM in the probe)
CRASH_LOGGERS = (*PREFECT_LOGGERS, "prefect.engine")
SIGNAL_CRASHES = ("aborted by an interrupt signal.", "aborted by a termination signal.")  # Prefect's state messages


class SweepInterrupted(KeyboardInterrupt):
    """Ctrl-C or SIGTERM stopped the sweep; what to run to continue it."""


class _NoSignalCrashes(logging.Filter):
    """Drops Prefect's errors about a run stopped by a signal — 'Crash detected! Execution was aborted by an interrupt
    signal.' (or 'by a termination signal.') and "Finished in state Crashed('Execution was aborted by …')": the stop
    line says where the run stopped and how to continue it."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(crash in message for crash in SIGNAL_CRASHES)


class _NoInterruptedTrials(logging.Filter):
    """Drops what is logged with a KeyboardInterrupt's traceback (Optuna's 'Trial N failed with parameters … because
    of the following error'), and Optuna's 'Trial N failed with value None' after it."""

    def __init__(self):
        super().__init__()
        self.interrupted: set[str] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if record.exc_info and isinstance(record.exc_info[1], KeyboardInterrupt):
            self.interrupted.add(message.split(" failed with parameters")[0])  # 'Trial 3'
            return False
        return not (
            message.endswith("failed with value None.") and message.split(" failed with value")[0] in self.interrupted
        )


class _NoInputErrorTracebacks(logging.Filter):
    """Drops what Prefect logs about a task or flow that raised bad input (an InputError, whatever wraps it): 'Task
    run failed with exception' and 'Encountered exception during execution' with their tracebacks, and the 'Finished
    in state Failed(...)' lines quoting it. The command prints the error's one line and exits 2 (flows/cli.py)."""

    def __init__(self):
        super().__init__()
        self.said: set[str] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        bad = input_error(record.exc_info[1]) if record.exc_info else None
        if bad is not None:
            self.said.add(str(bad))
            return False
        message = record.getMessage()
        return not any(said in message for said in self.said)


@contextmanager
def _filtered(filters: dict[logging.Filter, tuple[str, ...]]):
    """Each filter on its loggers for the block."""
    pairs = [(logging.getLogger(name), f) for f, names in filters.items() for name in names]
    for logger, f in pairs:
        logger.addFilter(f)
    try:
        yield
    finally:
        for logger, f in pairs:
            logger.removeFilter(f)


def signal_crashes_unsaid():
    """Around a run's command (`ballast run`): Prefect's errors about the signal that stopped it are not logged; the
    command prints its own stop line (tasks/results.py RunInterrupted)."""
    return _filtered({_NoSignalCrashes(): CRASH_LOGGERS, _NoInputErrorTracebacks(): PREFECT_LOGGERS})


@contextmanager
def interrupts_said_once(command: str):
    """Around a sweep command: a Ctrl-C (or SIGTERM) leaves the terminal with the interrupted trial's stop line and
    one SweepInterrupted naming `command` to continue the study — no tracebacks from the libraries under it."""
    with _filtered(
        {
            _NoSignalCrashes(): CRASH_LOGGERS,
            _NoInterruptedTrials(): ("optuna.study._optimize", *PREFECT_LOGGERS),
            _NoInputErrorTracebacks(): PREFECT_LOGGERS,
        }
    ):
        try:
            yield
        except KeyboardInterrupt as e:
            raise SweepInterrupted(
                f"sweep interrupted; its finished trials are kept — continue it with: {command}"
            ) from e
