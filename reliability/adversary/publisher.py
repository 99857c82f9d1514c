"""A publisher process the adversary and scenario 4 SIGKILL: ``python -m reliability.adversary.publisher ...``.

It publishes and commits the next policy version (``--count`` of them); ``ROLLFLEET_FAULT``
(see ``rollfleet.runtime.faults``) stops it at a publication or commit stage (scenario 4,
``reliability.scenarios.policy``). With ``--trainer-seed`` it publishes the adversary's trainer
weights (``reliability.adversary.trainer_weights``, in the lineage ``--adopted`` names;
``--perturb SALT``: a perturbed copy, as a racing publisher with another idea of the version
would), under ``--publisher NAME``, and refuses (exit 3) to publish any version but
``--expect-version`` (scenario 12's ``publisher_kill`` and ``publisher_race``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path


async def publish(args: argparse.Namespace) -> int:
    from harness.weights import tensors_at
    from rollfleet.trainer_client import PolicyPublisher, RolloutClient

    tensors = tensors_at
    if args.trainer_seed is not None:
        from reliability.adversary.trainer_weights import TrainerWeights

        adopted = {int(v): int(s) for v, s in json.loads(args.adopted or "{}").items()}
        weights = TrainerWeights(Path(args.base), args.trainer_seed, adopted)
        tensors = weights.at if args.perturb is None else (lambda v: weights.candidate(v, args.perturb))
    # The fleet's topology: a commit declares its version's job consumers (their ack-wait), and a
    # connection declares the streams (their duplicate window), as this process configures them.
    topology = {}
    if args.ack_wait is not None:
        from rollfleet.broker.topology import TopologyConfig

        topology["topology"] = TopologyConfig(
            ack_wait_s=args.ack_wait,
            duplicate_window_s=args.duplicate_window,
            max_deliver=args.max_deliver,
            replicas=args.stream_replicas,
        )
    async with await RolloutClient.connect(
        args.nats, namespace=args.namespace, client_id=args.client_id, fail_fast=False, **topology
    ) as client:
        publisher = PolicyPublisher(
            args.store, args.base, keyframe_every=args.keyframe_every, keep_last=None, publisher=args.publisher or ""
        )
        records = []
        for _ in range(args.count):
            version = 0 if publisher.latest_version is None else publisher.latest_version + 1
            if args.expect_version is not None and version != args.expect_version:
                print(json.dumps({"refused": version, "expected": args.expect_version}), flush=True)
                return 3
            named = tensors(version)
            if args.go_file:  # a race: every contender has read the store before any writes to it
                print(f"READY {version}", flush=True)
                deadline = time.monotonic() + 60.0
                while True:
                    if os.path.exists(args.go_file):
                        break
                    if time.monotonic() > deadline:
                        return 4
                    await asyncio.sleep(0.005)
                await asyncio.sleep(args.go_delay)
            record = await client.publish_policy(publisher, named)
            records.append(record.version)
        print(json.dumps({"published": records}), flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m reliability.adversary.publisher")
    p.add_argument("--nats", required=True)
    p.add_argument("--namespace", required=True)
    p.add_argument("--store", required=True)
    p.add_argument("--base", required=True)
    p.add_argument("--client-id", default="trainer")
    p.add_argument("--count", type=int, default=1)
    p.add_argument("--keyframe-every", type=int, default=0)
    p.add_argument("--trainer-seed", type=int, default=None, help="the adversary's trainer weights of this seed")
    p.add_argument("--adopted", default=None, help="JSON {version: salt}: perturbed versions the lineage adopted")
    p.add_argument("--perturb", type=int, default=None, help="publish a perturbed copy, seeded SALT")
    p.add_argument("--publisher", default=None, help="the publisher's name in its version record")
    p.add_argument("--expect-version", type=int, default=None, help="exit 3 rather than publish another version")
    p.add_argument("--go-file", default=None, help="print READY, then wait for this file before publishing")
    p.add_argument("--go-delay", type=float, default=0.0, help="seconds to wait after the go file appears")
    p.add_argument("--ack-wait", type=float, default=None, help="the fleet's topology (default: rollfleet's)")
    p.add_argument("--duplicate-window", type=float, default=600.0)
    p.add_argument("--max-deliver", type=int, default=10)
    p.add_argument("--stream-replicas", type=int, default=1, help="3 on a 3-node cluster")
    return asyncio.run(publish(p.parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
