"""The loop's prompts as read from the source: numbered as they arrive (rule 1), pending until
admitted (re-queued ones first), unresolved until their group is handed out or reported, whether
a key of the loop names an attempt no group will ask for again (rule 5), and whether the source
is open, dry or failed (its error raised once, rule 10). A small state holder;
``loop_machine.LoopMachine`` decides when each prompt moves.
"""

from __future__ import annotations

from collections import deque
from typing import Any, Literal

from rollfleet.schemas import RolloutPayload
from rollfleet.schemas.errors import InvalidRequest
from rollfleet.trainer_client.loop_config import LoopConfig
from rollfleet.trainer_client.loop_groups import InFlight, QueuedPrompt
from rollfleet.trainer_client.loop_keys import key_owner


def prompt_payload(item: Any, config: LoopConfig) -> RolloutPayload | InvalidRequest:
    """Rule 1: the request an item of the source asks for, or why it cannot be one."""
    if isinstance(item, RolloutPayload):
        base = item
    elif isinstance(item, str):
        base = RolloutPayload(prompt_text=item, sampling=config.sampling, extra=dict(config.extra))
    elif isinstance(item, list | tuple) and all(isinstance(t, int) and not isinstance(t, bool) for t in item):
        base = RolloutPayload(prompt_token_ids=list(item), sampling=config.sampling, extra=dict(config.extra))
    else:
        return InvalidRequest(f"a prompt is a RolloutPayload, a str or a list of token ids, got {type(item).__name__}")
    if not base.prompt_token_ids and not base.prompt_text:
        return InvalidRequest("a prompt is empty")
    return base


class PromptBook:
    """Prompts read: pending (not yet admitted) and unresolved (pending or in a group not yet
    complete), by their number in the source's order."""

    def __init__(self) -> None:
        self.read = 0  # items read from the source (the next one's number)
        self.pending: deque[QueuedPrompt] = deque()  # read, not yet admitted (re-queued ones first)
        self.unresolved: dict[int, QueuedPrompt] = {}  # prompts pending or in a group not yet complete
        self.source: Literal["open", "dry", "failed"] = "open"
        self.source_error: BaseException | None = None
        self._error_raised = False

    def number(self) -> int:
        """The number of the item just read."""
        no = self.read
        self.read += 1
        return no

    def add(self, no: int, item: Any, payload: RolloutPayload) -> None:
        p = QueuedPrompt(no, item, payload)
        self.pending.append(p)
        self.unresolved[no] = p

    def requeue(self, p: QueuedPrompt) -> None:
        """``p`` goes back, ahead of the prompts not yet tried."""
        self.pending.appendleft(p)

    def resolve(self, no: int) -> None:
        """Prompt ``no`` is done with: handed out, reported, dropped or forgotten."""
        self.unresolved.pop(no, None)

    def error_to_raise(self) -> BaseException | None:
        """The source's error, the first time it is asked for (rule 10); None after, or without."""
        if self.source_error is None or self._error_raised:
            return None
        self._error_raised = True
        return self.source_error

    def requeue_or_resolve(self, no: int, requeue: bool) -> bool:
        """Prompt ``no``, its group dropped: back ahead of the rest (``requeue``, while it is
        unresolved), else done with. Whether it went back."""
        p = self.unresolved.get(no)
        if requeue and p is not None:
            self.requeue(p)
            return True
        self.resolve(no)
        return False

    def owns(self, key: str, loop_id: str, closed: bool, flight: InFlight) -> bool:
        """``LoopMachine.owns``: whether ``key``, which no job waits for, is a key of loop
        ``loop_id`` (rule 5) that no group will ask for again: its prompt read and resolved or past
        the attempt it names, or at it with no group in flight that may go on asking; any of its
        keys once ``closed``. A prompt not yet read may still be asked (a restarted loop reclaims
        it)."""
        owner = key_owner(key)
        if owner is None or owner[0] != loop_id or key in flight.pieces:
            return False
        if closed:
            return True
        _, prompt_no, attempt = owner
        if prompt_no >= self.read:
            return False  # not read yet
        p = self.unresolved.get(prompt_no)
        if p is None or attempt < p.attempts:
            return True  # resolved, or an earlier attempt's
        if attempt > p.attempts:
            return False  # an attempt still to come
        return not any(g.prompt is p for g in flight.groups.values())  # (a live group may go on asking)
