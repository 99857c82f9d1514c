"""Rule 5, the loop's job keys: a job's idempotency key is a function of the loop's id, the
prompt's number, its attempt, the piece's round and samples, and its floor's distance below
latest, so a loop restarted with the same client id, loop id and prompts asks for the same jobs
(and the client hands it its predecessor's jobs and stored answers). ``key_owner`` reads a key
back.
"""

from __future__ import annotations

import re
from collections.abc import Sequence


def job_key(loop_id: str, prompt_no: int, attempt: int, round_: int, indices: Sequence[int], allowance: int) -> str:
    """Rule 5: the idempotency key of a job (``allowance``: its floor's distance below latest)."""
    samples = "g" if len(indices) > 1 else f"s{indices[0]}"
    return f"loop:{loop_id}:p{prompt_no}:a{attempt}:r{round_}:{samples}:d{allowance}"


_KEY = re.compile(r"^loop:(?P<loop>[A-Za-z0-9_-]+):p(?P<prompt>\d+):a(?P<attempt>\d+):r\d+:(g|s\d+):d\d+$")


def key_owner(key: str) -> tuple[str, int, int] | None:
    """(loop id, prompt number, attempt) of a key ``job_key`` made; None for any other key."""
    m = _KEY.match(key)
    return (m["loop"], int(m["prompt"]), int(m["attempt"])) if m else None
