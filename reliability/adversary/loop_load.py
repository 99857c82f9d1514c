"""The adversary's rollout loop: a trainer running ``RolloutLoop`` inside the trainer process.

One lane of ``reliability.adversary.load``. Each life of the loop is drawn from the seed
(``LoopPlan.draw``: group size, batch size, ``max_staleness``, split or unsplit groups, partial
rollouts, oversampling and tail cancels, dynamic sampling, a group deadline, a failure and a
retry policy, a cap on groups in flight) and
fed by a prompt source that sometimes sleeps seconds between prompts (a slow dataset, a remote
prompt server), half its prompts seeded (``SamplingParams.seed``). The trainer takes batches,
"trains" a moment, and after each batch asks the harness for the next version (a ``loop_step``
record: ``reliability.adversary.run`` publishes and commits it, at most one every
``LOOP_PUBLISH_GAP_S``, until the trainer ends), waiting a few seconds for it as a trainer waits
for its own publish: the loop admits new groups only as versions are committed (its staleness
bound), so a trainer that stopped publishing would wait for ever. The source runs dry at the
life's end; the trainer takes batches a few seconds more (``LAST_BATCH_S``) and ``close()``s the
loop with whatever is still in flight or ready.

The first life runs on a client of its own (client id ``loop-<incarnation>``: every job the
wiretap sees under it is the loop's); with time left, a second life runs on the same client after
the first closed (an evaluation pass after training: a second ``RolloutLoop`` on one client).

Journaled, fsynced, for the oracle (``reliability.adversary.oracle_loop``): ``loop_open`` (the
plan, the client id), ``loop_batch`` (each group as the trainer received it: its prompt, seed and
``max_tokens`` from the source's own item, every sample's tokens, spans and finish reason; the
trainer's version before it asked), ``loop_step``, ``loop_close`` (the loop's ``totals`` after
``close()``), and ``loop_error`` / ``loop_hang`` (the loop raised, or did not return). Nothing here
checks anything.
"""

from __future__ import annotations

import asyncio
import os
import random
import time
from dataclasses import asdict, dataclass
from typing import Any

from reliability.adversary.journal import describe_error

LOOP_PUBLISH_GAP_S = 3.0  # the harness publishes a loop's step at most this often
STEP_WAIT_S = 6.0  # after a step, how long the trainer waits for the version it asked for
LAST_BATCH_S = 4.0  # after the source ran dry, the trainer asks for batches this long, then closes the loop
DRAIN_S = 75.0  # a next_batch (or close) that takes this long past the source's end has hung
SLOW_SOURCE_S = (1.0, 4.0)  # a slow source's sleep between two prompts


@dataclass(frozen=True)
class LoopPlan:
    """One life's settings, drawn from the seed."""

    group_size: int
    batch_groups: int
    max_staleness: int
    split_groups: bool
    partial_rollout: bool
    oversample: int
    stale: str
    on_failure: str
    max_in_flight: int | None
    dynamic_sampling: bool
    group_deadline_s: float | None
    retry_policy: str
    seeded_share: float  # of the prompts, seeded
    slow_share: float  # of the prompts, preceded by a sleep of the source
    long_share: float  # of the prompts, long (a tail)

    @staticmethod
    def draw(rng: random.Random) -> LoopPlan:
        return LoopPlan(
            group_size=rng.choice((2, 3, 4)),
            batch_groups=rng.choice((1, 2)),
            max_staleness=rng.choice((0, 1, 1, 2)),
            split_groups=rng.random() < 0.5,
            partial_rollout=rng.random() < 0.5,
            oversample=rng.choice((0, 0, 1)),
            stale=rng.choice(("drop", "drop", "requeue", "keep")),
            on_failure=rng.choice(("requeue", "requeue", "report")),
            max_in_flight=rng.choice((None, None, 2)),
            dynamic_sampling=rng.random() < 0.3,
            group_deadline_s=rng.choice((None, None, 25.0)),
            retry_policy=rng.choice(("replayable", "replayable", "at_most_once", "resume")),
            seeded_share=0.5,
            slow_share=rng.choice((0.1, 0.25)),
            long_share=0.15,
        )

    def config(self) -> Any:
        from rollfleet.trainer_client import LoopConfig

        return LoopConfig(
            group_size=self.group_size,
            batch_groups=self.batch_groups,
            max_staleness=self.max_staleness,
            split_groups=self.split_groups,
            partial_rollout=self.partial_rollout,
            oversample=self.oversample,
            stale=self.stale,  # type: ignore[arg-type]
            on_failure=self.on_failure,  # type: ignore[arg-type]
            max_in_flight=self.max_in_flight,
            dynamic_sampling=self.dynamic_sampling,
            group_deadline_s=self.group_deadline_s,
            retry_policy=self.retry_policy,  # type: ignore[arg-type]
            job_timeout_s=30.0,
            activation_grace_s=5.0,
        )


def sample_record(sample: Any) -> dict[str, Any]:
    """A trained sample as the trainer received it."""
    return {
        "tokens": list(sample.tokens),
        "spans": [[int(s.version), int(s.start), int(s.end), s.replica] for s in sample.spans],
        "finish": sample.finish_reason,
        # Each run that made its tokens: where it began, the sample's index in its answer, and the
        # seed its replica used (the request's, or one drawn for an unseeded request).
        "runs": [[int(r.start), int(r.index), _seed_of(r.coordinate)] for r in sample.replay],
    }


def _seed_of(coordinate: Any) -> int | None:
    seed = None if coordinate is None else coordinate.sampling.seed
    return None if seed is None else int(seed)


def group_record(group: Any) -> dict[str, Any]:
    """A trained group: its prompt as the source gave it (the trainer's own item), its samples,
    and the job ids of the answers it was made from (for reading, never judged)."""
    prompt = group.prompt
    return {
        "prompt": list(prompt.prompt_token_ids or []),
        "seed": prompt.sampling.seed,
        "max_tokens": int(prompt.sampling.max_tokens),
        "samples": [sample_record(s) for s in group.samples],
        "jobs": [r.job_id for r in getattr(group, "results", []) or []],
    }


async def reward(group: Any) -> list[float]:
    """A toy reward that differs between distinct samples (the parity of each sample's last token):
    a group of copies has equal rewards, which dynamic sampling filters."""
    return [float(s.tokens[-1] % 2) if s.tokens else 0.0 for s in group.samples]


class LoopLane:
    """The loop lane of one trainer incarnation (``load.Load``: its journal, its stop time, its args)."""

    def __init__(self, load: Any) -> None:
        self.load = load
        self.rng = random.Random(f"loop:{load.args.seed}:{load.inc}")
        self.client: Any = None
        self.client_id = f"loop-{load.inc}"
        self.prompts = 0

    def log(self, record: dict[str, Any]) -> None:
        self.load.log(record)

    async def run(self) -> None:
        from rollfleet.broker.topology import TopologyConfig
        from rollfleet.trainer_client import RolloutClient

        a = self.load.args
        end = self.load.stop_at
        if end - time.time() < 4.0:
            return
        topo = TopologyConfig(
            ack_wait_s=a.ack_wait, duplicate_window_s=a.duplicate_window, max_deliver=a.max_deliver,
            replicas=a.stream_replicas,
        )  # fmt: skip
        url = os.environ.get("RF_ADV_TRAINER_URL", a.nats)
        try:
            self.client = await asyncio.wait_for(
                RolloutClient.connect(
                    url, namespace=a.namespace, client_id=self.client_id, topology=topo, default_timeout_s=30.0
                ),
                60.0,
            )
        except Exception as exc:
            self.log({"ev": "loop_error", "loop": f"L{self.load.inc}", "where": "connect", **describe_error(exc)})
            return
        try:
            lives = 2 if end - time.time() >= 20.0 else 1
            for life in range(lives):
                left = end - time.time()
                if left < 4.0:
                    break
                # (the last life's source runs dry a little early: its last batches end near the run's)
                until = end - 2.0 if life == lives - 1 else time.time() + left * 0.6
                await self.life(life, until)
        finally:
            await self.client.close()

    async def source(self, lid: str, plan: LoopPlan, until: float) -> Any:
        """Prompts until ``until``, now and then after a sleep of seconds; half of them seeded."""
        from rollfleet.schemas import RolloutPayload, SamplingParams

        rng = self.rng
        while time.time() < until:
            if rng.random() < plan.slow_share:
                pause = rng.uniform(*SLOW_SOURCE_S)
                self.log({"ev": "loop_source_sleep", "loop": lid, "s": round(pause, 3)})
                await asyncio.sleep(min(pause, max(0.0, until - time.time())))
                if time.time() >= until:
                    break
            self.prompts += 1
            long = rng.random() < plan.long_share
            tokens = rng.randint(150, 300) if long else rng.randint(8, 80)
            seed = rng.randrange(1, 2**31) if rng.random() < plan.seeded_share else None
            head = [self.load.inc + 1, self.prompts % 500 + 1]
            prompt = [*head, *(rng.randrange(1, 500) for _ in range(rng.randint(1, 8)))]
            yield RolloutPayload(prompt_token_ids=prompt, sampling=SamplingParams(max_tokens=tokens, seed=seed))

    async def life(self, life: int, until: float) -> None:
        from rollfleet.trainer_client import RolloutLoop

        lid = f"L{self.load.inc}.{life}"
        plan = LoopPlan.draw(self.rng)
        self.log({"ev": "loop_open", "loop": lid, "client_id": self.client_id, "life": life, "plan": asdict(plan),
                  "until": until, "latest": self.client.latest_version})  # fmt: skip
        try:
            loop = RolloutLoop(self.client, self.source(lid, plan, until), plan.config(), reward=reward)
        except Exception as exc:  # (a second loop on one client once could not be made)
            self.log({"ev": "loop_error", "loop": lid, "where": "construct", **describe_error(exc)})
            return
        step = 0
        try:
            # Batches until the source ran dry (None) or for LAST_BATCH_S after it did; then the loop
            # is closed with whatever is still in flight or ready (counted as waste "closed").
            while time.time() < until + LAST_BATCH_S:
                before = self.client.latest_version
                t_asked = time.time()
                bound = max(1.0, until + DRAIN_S - t_asked)
                try:
                    batch = await asyncio.wait_for(loop.next_batch(), bound)
                except TimeoutError:
                    self.log({"ev": "loop_hang", "loop": lid, "where": "next_batch", "t_asked": t_asked,
                              "waited_s": round(time.time() - t_asked, 3)})  # fmt: skip
                    break
                if batch is None:
                    break
                step += 1
                self.log(
                    {
                        "ev": "loop_batch",
                        "loop": lid,
                        "step": step,
                        "t_asked": t_asked,
                        "version_before": before,
                        "version_after": self.client.latest_version,
                        "labelled": batch.version,  # (the loop's own label: read, never judged)
                        "groups": [group_record(g) for g in batch.groups],
                        "failed": len(batch.failed),
                    }
                )
                # The optimizer step, then its version published (by the harness: a loop_step record),
                # as a trainer does after every step: the loop's admission waits for it.
                await asyncio.sleep(self.rng.uniform(0.1, 0.6))
                asked = self.client.latest_version
                self.log({"ev": "loop_step", "loop": lid, "step": step, "version": asked})
                deadline = time.time() + STEP_WAIT_S
                while time.time() < deadline:
                    if self.client.latest_version != asked:
                        break
                    await asyncio.sleep(0.1)
        except Exception as exc:
            self.log({"ev": "loop_error", "loop": lid, "where": "next_batch", **describe_error(exc)})
        t_close = time.time()
        try:
            await asyncio.wait_for(loop.close(), DRAIN_S)
        except TimeoutError:
            self.log({"ev": "loop_hang", "loop": lid, "where": "close", "t_asked": t_close,
                      "waited_s": round(time.time() - t_close, 3)})  # fmt: skip
            return
        except Exception as exc:
            self.log({"ev": "loop_error", "loop": lid, "where": "close", **describe_error(exc)})
            return
        self.log(
            {
                "ev": "loop_close",
                "loop": lid,
                "t_close": t_close,
                "totals": {str(k): v for k, v in dict(loop.totals).items()},
                "failed": len(getattr(loop, "failed", []) or []),
                "steps": step,
            }
        )
