"""The loop's prompts as read from the source: numbered as they arrive (rule 1), pending until
admitted (re-queued ones first), unresolved until their group is handed out or reported, and
whether a key of the loop names an attempt no group will ask for again (rule 5). A small state
holder; ``loop_machine.LoopMachine`` decides when each prompt moves.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from typing import Any

from rollfleet.schemas import RolloutPayload
from rollfleet.trainer_client.loop_groups import QueuedPrompt


class PromptBook:
    """Prompts read: pending (not yet admitted) and unresolved (pending or in a group not yet
    complete), by their number in the source's order."""

    def __init__(self) -> None:
        self.read = 0  # items read from the source (the next one's number)
        self.pending: deque[QueuedPrompt] = deque()  # read, not yet admitted (re-queued ones first)
        self.unresolved: dict[int, QueuedPrompt] = {}  # prompts pending or in a group not yet complete

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

    def clear(self) -> None:
        self.pending.clear()
        self.unresolved.clear()

    def past_attempt(self, prompt_no: int, attempt: int, live: Iterable[QueuedPrompt]) -> bool:
        """Whether no group will ask again for attempt ``attempt`` of prompt ``prompt_no``: read,
        and resolved or past that attempt, or at it with no group in flight (``live``: the prompts
        of the groups in flight) that may go on asking. A prompt not yet read may still be asked
        (a restarted loop reclaims it)."""
        if prompt_no >= self.read:
            return False  # not read yet
        p = self.unresolved.get(prompt_no)
        if p is None or attempt < p.attempts:
            return True  # resolved, or an earlier attempt's
        if attempt > p.attempts:
            return False  # an attempt still to come
        return not any(q is p for q in live)  # (a live group may go on asking)
