"""The HTML pages Ballast writes (run report, probe report, sweep summary, comparison), from jinja2 templates in
tasks/templates/. Every page is one self-contained file: styles inline, plots embedded as data URIs, so it can be
mailed, logged to MLflow as an artifact and opened from anywhere. Numbers are formatted by the filters here, one
place, so no page shows a 17-digit float or a Python repr.
"""

from __future__ import annotations

import base64
import math
import re
import subprocess
from pathlib import Path

from jinja2 import Environment, PackageLoader, StrictUndefined, select_autoescape

_ENV = Environment(
    loader=PackageLoader("tasks", "templates"),
    autoescape=select_autoescape(["html"]),
    undefined=StrictUndefined,
    trim_blocks=True,
    lstrip_blocks=True,
)


def number(value, digits: int = 3) -> str:
    """A number as people read it: ints as ints, floats to `digits` significant decimals, None/NaN as '—'."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "—"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int) or (isinstance(value, float) and value.is_integer() and abs(value) < 1e15):
        return f"{int(value):,}"
    if isinstance(value, float):
        if abs(value) < 1e-3 or abs(value) >= 1e6:
            return f"{value:.{digits}g}"
        return f"{value:.{digits}f}".rstrip("0").rstrip(".")  # 318.0004 -> '318', not '318.'
    return str(value)


def significant(value, digits: int = 2) -> str:
    """A number to `digits` significant digits (p-values, odds ratios: 0.0076, 1.8e-17), None/NaN as '—'."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "—"
    return f"{value:.{digits}g}"


def percent(value, digits: int = 1) -> str:
    return "—" if value is None else f"{100 * value:.{digits}f}%"


def data_uri(path: str | Path) -> str:
    return "data:image/png;base64," + base64.b64encode(Path(path).read_bytes()).decode()


def png_width(path: str | Path) -> int:
    """A PNG's width in pixels (its IHDR chunk): a page lays a plot wider than its grid's cell across the row."""
    return int.from_bytes(Path(path).read_bytes()[16:20], "big")


def commit_link(commit: str, remote: str | None = None) -> str | None:
    """A web link to the commit when the checkout's origin (or `remote`) is on GitHub, GitLab or Bitbucket;
    else None."""
    if remote is None:
        try:
            remote = subprocess.run(
                ["git", "config", "--get", "remote.origin.url"],
                cwd=Path(__file__).parent,
                capture_output=True,
                text=True,
                timeout=10,
            ).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return None
    m = re.match(r"(?:https://|git@|ssh://git@)([^/:]+)[/:](.+?)(?:\.git)?$", remote)
    if not m or commit in ("", "unknown"):
        return None
    host, repo = m.groups()
    path = "-/commit" if "gitlab" in host else "commits" if "bitbucket" in host else "commit"
    return f"https://{host}/{repo}/{path}/{commit}"


def episode_turns(conversation: str, prompt: str) -> str:
    """A multi-turn episode as a samples table shows it: its messages from the row's own question on — the model's
    turns (marked `| loss`, the tokens trained on), its tool calls and the tools' results — without the system prompt
    and worked examples before it; the whole conversation when the question is not found in it."""
    question = f"[user] {prompt}"
    at = conversation.rfind(question)
    return conversation if at < 0 else conversation[at + len(question) :].lstrip("\n")


_ENV.filters.update(
    number=number,
    significant=significant,
    percent=percent,
    data_uri=data_uri,
    png_width=png_width,
    commit_link=commit_link,
    episode_turns=episode_turns,
)


def render_page(template: str, path: str | Path, **context) -> Path:
    """Render tasks/templates/<template> with `context` into `path`; returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(_ENV.get_template(template).render(**context), encoding="utf-8")
    return path
