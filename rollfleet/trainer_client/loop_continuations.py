"""An answer's samples, decided without I/O: each output of a job either finishes its sample or,
aborted with tokens left to make (a job stopped, rule 7), goes on from its tokens so far as a
job of that sample alone (rule 4), at the floor the stop chose, else the floor new jobs ask for
now. ``loop_machine.LoopMachine.answered`` asks for the continuations this returns.
"""

from __future__ import annotations

from dataclasses import dataclass

from rollfleet.schemas import RolloutPayload, RolloutResult
from rollfleet.schemas.errors import ContractViolation, InvalidRequest
from rollfleet.trainer_client.loop_groups import GroupInFlight, Piece
from rollfleet.trainer_client.loop_samples import continuable, continuation, run_sample


@dataclass(frozen=True)
class GoOn:
    """Sample ``index`` goes on as a job of its own asking ``payload`` at ``floor``."""

    index: int
    payload: RolloutPayload
    floor: int


def take_outputs(
    g: GroupInFlight, piece: Piece, result: RolloutResult, floor_now: int | None
) -> tuple[list[GoOn], BaseException | None]:
    """Fill ``g``'s slots from ``piece``'s answer (one output per sample it asked for): what goes
    on, and why the group fails (None: it does not): an answer with other than one output per
    sample asked for, or a sample aborted before its first token not by the loop. ``floor_now``:
    the floor new jobs would ask for now (None: none yet). The continuations met before a failing
    output are returned with its error."""
    if len(result.outputs) != len(piece.indices):
        return [], ContractViolation(f"{len(result.outputs)} samples answered for {len(piece.indices)} asked")
    going_on: list[GoOn] = []
    base = g.prompt.payload
    for at, (i, out) in enumerate(zip(piece.indices, result.outputs, strict=True)):
        slot = g.slots[i]
        sample = run_sample(result, out, slot.prefix, at)
        left = piece.payload.sampling.max_tokens - len(out.token_ids)
        if out.finish_reason == "abort" and left > 0 and continuable(base):
            if not out.token_ids and piece.stopping != "refresh":
                return going_on, InvalidRequest(f"sample {i} was aborted before its first token, not by the loop")
            slot.prefix = sample
            floor = piece.refresh_floor if piece.stopping == "refresh" else floor_now
            floor = piece.floor if floor is None else floor
            going_on.append(GoOn(i, continuation(base, i, sample.tokens, left), floor))
            g.continued_at = max(g.continued_at if g.continued_at is not None else floor, floor)
        else:
            slot.done = sample
    return going_on, None
