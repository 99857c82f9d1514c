"""The configuration reference's table of worker settings, made from the one table
(``workers/worker_settings.py``) that ``WorkerConfig`` and ``rollfleet worker`` take their defaults
from. docs/configuration.md holds it between two markers; ``tests/test_worker_settings.py`` fails
when the page says something else. To write it again after changing the table:

    python -m rollfleet.cli.reference docs/configuration.md
"""

from __future__ import annotations

import sys
from pathlib import Path

from rollfleet.workers.worker_settings import WORKER_SETTINGS, WorkerSetting, shown

BEGIN = "<!-- worker-defaults:begin -->"
END = "<!-- worker-defaults:end -->"
_MADE_BY = "<!-- made by `python -m rollfleet.cli.reference`: edit rollfleet/workers/worker_settings.py, not here -->"


def _default(s: WorkerSetting) -> str:
    if s.cli_default is None:
        return shown(s.default)
    return f"{shown(s.cli_default)} (`WorkerConfig`: {shown(s.default)})"


def _row(s: WorkerSetting) -> str:
    flag = f"`{s.flag}`" if s.flag is not None else ""
    meaning = f"{s.meaning}. {s.note}" if s.note else s.meaning
    return f"| `{s.field}` | {flag} | {_default(s)} | {meaning} |"


def worker_defaults_markdown() -> str:
    """The reference's rows for every worker setting, markers included."""
    head = ["| `WorkerConfig` | `rollfleet worker` | default | meaning |", "|---|---|---|---|"]
    return "\n".join([BEGIN, _MADE_BY, *head, *(_row(s) for s in WORKER_SETTINGS), END])


def marked_block(text: str) -> str | None:
    """The block between the markers in ``text``, markers included (None: no markers)."""
    start, end = text.find(BEGIN), text.find(END)
    if start < 0 or end < start:
        return None
    return text[start : end + len(END)]


def write_into(path: Path) -> bool:
    """Write the generated block into ``path`` between its markers; whether it changed."""
    text = path.read_text()
    block = marked_block(text)
    if block is None:
        raise SystemExit(f"{path}: no {BEGIN!r} ... {END!r} markers")
    new = text.replace(block, worker_defaults_markdown())
    path.write_text(new)
    return new != text


if __name__ == "__main__":
    for name in sys.argv[1:] or ["docs/configuration.md"]:
        print(f"{name}: {'written' if write_into(Path(name)) else 'already current'}")
