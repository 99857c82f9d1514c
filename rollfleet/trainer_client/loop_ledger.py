"""Rule 11, the loop's accounting of tokens: every token of every answer the loop receives
(``generated_tokens``) is at every moment exactly one of trained (``tokens``), held (in a group
in flight, being scored or ready) or waste with a cause. ``TokenLedger`` keeps the counts over the
loop's life (``LoopMachine.totals``) and the waste since the last batch; ``LoopMachine`` tells it
what happened.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

from rollfleet.schemas import RolloutResult
from rollfleet.trainer_client.loop_samples import result_tokens
from rollfleet.trainer_client.loop_types import Group, WasteCause, Wasted


class TokenLedger:
    """The loop's counts: generated, trained and wasted tokens (and groups) by cause."""

    def __init__(self) -> None:
        self._received: dict[str, tuple[str, int]] = {}  # key -> (job id, tokens) of the answer used
        self._waste_tokens: Counter[str] = Counter()  # since the last batch
        self._waste_groups: Counter[str] = Counter()
        # Over the loop's life: admitted, completed, requeued, failed, continued, batches, groups,
        # samples, tokens (trained), generated_tokens, waste_tokens_<cause>, waste_groups_<cause>.
        self.totals: Counter[str] = Counter()

    def answered(self, key: str, result: RolloutResult) -> int:
        """An answer a job of the loop waited for: its tokens, generated (and held from now)."""
        tokens = result_tokens(result)
        self.totals["generated_tokens"] += tokens
        self._received[key] = (result.job_id, tokens)
        return tokens

    def orphaned(self, key: str, outcome: Any) -> tuple[int, bool]:
        """An answer under the loop's key that no job waits for: its tokens, and whether it is the
        very answer already received for the key (the same job, as many tokens: a delivery
        repeated, e.g. to a restarted loop that also found it stored), which is no new token and
        not counted."""
        tokens = result_tokens(outcome) if isinstance(outcome, RolloutResult) else 0
        if isinstance(outcome, RolloutResult) and self._received.get(key) == (outcome.job_id, tokens):
            return tokens, True
        self.totals["generated_tokens"] += tokens
        return tokens, False

    def waste(self, tokens: int, cause: WasteCause, groups: int = 1) -> Wasted:
        self._waste_tokens[cause] += tokens
        self._waste_groups[cause] += groups
        self.totals[f"waste_tokens_{cause}"] += tokens
        self.totals[f"waste_groups_{cause}"] += groups
        return Wasted(cause, tokens)

    def handed_out(self, taken: Sequence[Group]) -> tuple[dict[str, int], dict[str, int]]:
        """A batch of ``taken`` was handed out: counted as trained; returns the waste (tokens,
        groups by cause) since the batch before, and starts counting it afresh."""
        since = dict(self._waste_tokens), dict(self._waste_groups)
        self._waste_tokens, self._waste_groups = Counter(), Counter()
        self.totals.update(
            batches=1,
            groups=len(taken),
            samples=sum(len(g.samples) for g in taken),
            tokens=sum(g.tokens for g in taken),
        )
        return since
