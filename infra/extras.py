"""Optional extras: what a feature needs installed beyond `pip install ballast`, refused in one line naming the extra.

    cloud   skypilot          infra.compute: skypilot, `ballast launch`, sweep workers on SkyPilot nodes
    bench   trl, accelerate   the benchmarks that run TRL beside Ballast (bench/trl_step_time.py, bench/memory.py)

(pyproject.toml's [project.optional-dependencies] is the other half of this table.) A feature calls `require_extra`
before it imports the package, so a missing one is `MissingExtra` — an InputError: exit status 2, one line with the
`pip install` that adds it — from `ballast validate` and from the run alike, instead of a ModuleNotFoundError from
deep inside a check. It asks the import system whether the package's modules can be found (`importlib.util.find_spec`)
and imports nothing: SkyPilot takes seconds to import, and validation must not.

vLLM is not an extra: its pins conflict with Prefect's, so it lives in its own environment (`ballast vllm-env`),
checked where the rollout engine is (trainer/locate.py).
"""

from __future__ import annotations

import importlib.util
import sys

from trainer.config import InputError

EXTRAS = {  # extra: (the modules it installs, the package it is named for)
    "cloud": (("sky",), "SkyPilot"),
    "bench": (("trl", "accelerate"), "TRL and accelerate"),
}


class MissingExtra(InputError):
    """A feature whose optional extra is not installed; the message names the feature and the install command."""


def installed(module: str) -> bool:
    """Whether `module` can be imported here, without importing it (a finder that refuses it counts as missing)."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def require_extra(extra: str, feature: str) -> None:
    """MissingExtra unless every module of `extra` can be imported; `feature` names what needs it, as the user set it
    (e.g. 'infra.compute: skypilot')."""
    modules, package = EXTRAS[extra]
    missing = [m for m in modules if not installed(m)]
    if missing:
        raise MissingExtra(
            f"{feature} needs {package}, not installed here (no module {missing[0]!r}); install the '{extra}' "
            f"extra: pip install 'ballast[{extra}]' (from a checkout: pip install -e '.[{extra}]')"
        )


def exit_unless_installed(extra: str, feature: str) -> None:
    """For a script outside the `ballast` command (bench/): `require_extra`, its refusal printed as the command's
    would be — one line on stderr, exit status 2."""
    try:
        require_extra(extra, feature)
    except MissingExtra as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
