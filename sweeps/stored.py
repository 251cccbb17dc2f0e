"""What a sweep's study was created with, read without the trial machinery (no torch): `ballast validate SWEEP`
checks a file against the study `ballast sweep` would resume (flows/commands.py), and open_study refuses a changed
one with the same rule (sweeps/study.py)."""

from __future__ import annotations

import json
from pathlib import Path

from .space import SweepError, SweepSpec

SWEEP_ATTR = "ballast.sweep"  # study user attr: the sweep definition (JSON)


def check_definition(sweep: SweepSpec, stored: str) -> None:
    """The sweep file against the definition its study was created with (study user attr SWEEP_ATTR): a resume may
    change the trial count, storage and what happens after the search, nothing else."""
    before = SweepSpec.model_validate(json.loads(stored)).definition()
    now = sweep.definition()
    changed = next((k for k in now if before.get(k) != now.get(k)), None)
    if changed:
        raise SweepError(
            f"study {sweep.study_name!r} already exists in this storage with a different '{changed}'; resume it "
            "with the sweep file it started with (only trials may change), or name a new study"
        )


def storage_url(sweep: SweepSpec) -> str:
    """The storage `ballast sweep FILE` would open (no --storage): the file's, else the project folder's SQLite file,
    as sweeps/study.py `study_storage` says it (not created here)."""
    from .space import base_spec

    if sweep.storage:
        return sweep.storage
    return f"sqlite:///{Path(base_spec(sweep).get('project_dir', '.ballast')).resolve() / 'optuna.db'}"


def stored_definition(sweep: SweepSpec, url: str) -> str | None:
    """The definition the sweep's study was created with in `url`, or None when there is no such study (a SQLite
    file that does not exist is not created)."""
    import optuna

    if url.startswith("sqlite:///") and not Path(url.removeprefix("sqlite:///")).exists():
        return None
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    storage = optuna.storages.RDBStorage(url, skip_table_creation=False)
    names = {s.study_name for s in optuna.get_all_study_summaries(storage, include_best_trial=False)}
    if sweep.study_name not in names:
        return None
    return optuna.load_study(study_name=sweep.study_name, storage=storage).user_attrs.get(SWEEP_ATTR)
