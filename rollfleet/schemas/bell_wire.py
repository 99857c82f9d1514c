"""The bells' payloads: what a client's wake-up to one replica says (a jobs subject with work on
it, whether it stalled, and how long its oldest job waited), and the bell that ends a session's
cached context. The subjects they travel on are ``Names``'."""

from __future__ import annotations

from collections.abc import Mapping

from rollfleet.schemas.names import _TOKEN, ConstraintKind, _parse_constraint, check_token


def bell_payload(kind: ConstraintKind, version: int, *, stalled: bool = False) -> bytes:
    """``stalled``: the client saw jobs there and no pull request waiting for them."""
    return f"{kind}.{int(version)}{'.stalled' if stalled else ''}".encode()


# How long the oldest job a stalled bell rings for has waited, in ms by its client's clock: a
# header, so a worker that does not read it still takes the bell.
BELL_WAITED_HEADER = "Rollfleet-Waited-Ms"
BELL_WAITED_MAX_S = 86_400.0


def bell_waited_headers(waited_s: float) -> dict[str, str] | None:
    """The headers of a bell for jobs that have waited ``waited_s`` (None: no wait to say)."""
    ms = int(waited_s * 1000)
    return {BELL_WAITED_HEADER: str(ms)} if ms > 0 else None


def bell_waited_s(headers: Mapping[str, str] | None) -> float:
    """A bell's ``BELL_WAITED_HEADER`` in seconds: 0 when absent or not a whole number of ms,
    at most ``BELL_WAITED_MAX_S`` (anyone may ring: a wait is a hint, bounded)."""
    raw = (headers or {}).get(BELL_WAITED_HEADER, "")
    if not (raw.isascii() and raw.isdigit()):
        return 0.0
    return min(int(raw) / 1000, BELL_WAITED_MAX_S)


def parse_bell_payload(data: bytes) -> tuple[tuple[ConstraintKind, int], bool] | None:
    """``((kind, version), stalled)`` of a bell; None for anything else."""
    text = data.decode(errors="replace")
    stalled = text.endswith(".stalled")
    subject = _parse_constraint("", text.removesuffix(".stalled"))
    return None if subject is None else (subject, stalled)


def end_session_payload(session_id: str) -> bytes:
    """A bell saying: drop this session's cached context (the session ended)."""
    return f"end.{check_token(session_id, 'session_id')}".encode()


def parse_end_session(data: bytes) -> str | None:
    text = data.decode(errors="replace")
    if not text.startswith("end."):
        return None
    session_id = text[4:]
    return session_id if _TOKEN.match(session_id) else None
