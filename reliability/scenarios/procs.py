"""The trainer process scenario 7 SIGKILLs: ``python -m reliability.scenarios.procs --phase first|resume ...``.

A training loop that journals what it submitted and consumed; ``--phase first`` runs until
killed, ``--phase resume`` recovers and carries on, then prints a JSON summary on its last line.
(The publisher process scenario 4 SIGKILLs is the adversary's, ``reliability.adversary.publisher``.)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path


class Journal:
    """An append-only, fsynced record of what the training loop did (its own durable state)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.f = open(path, "a")

    def write(self, kind: str, value: str) -> None:
        self.f.write(f"{kind} {value}\n")
        self.f.flush()
        os.fsync(self.f.fileno())

    @staticmethod
    def read(path: Path) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {"S": [], "C": [], "V": []}
        if path.exists():
            for line in path.read_text().splitlines():
                kind, _, value = line.partition(" ")
                if kind in out and value:
                    out[kind].append(value)
        return out


async def trainer(args: argparse.Namespace) -> int:
    from harness.weights import tensors_at
    from reliability.scenarios.common import Ledger, job_payload
    from rollfleet.trainer_client import PolicyPublisher, RolloutClient

    journal_path = Path(args.journal)
    client = await RolloutClient.connect(args.nats, namespace=args.namespace, client_id=args.client_id)
    ledger = Ledger(client)
    publisher = PolicyPublisher(args.store, args.base, keep_last=None)
    journal = Journal(journal_path)

    async def publish_next() -> int:
        version = 0 if publisher.latest_version is None else publisher.latest_version + 1
        record = await client.publish_policy(publisher, tensors_at(version))
        journal.write("V", str(record.version))
        return record.version

    try:
        if args.phase == "first":
            await publish_next()
            await publish_next()
            await client.wait_for_version(1, replicas=args.replicas, timeout=30)
            handles = {}
            for i in range(args.jobs):
                key = f"s7/{i}"
                handles[key] = await client.submit(job_payload(i), min_version=0, idempotency_key=key)
                journal.write("S", key)
            consumed = 0
            for fut in asyncio.as_completed([h.result(120) for h in handles.values()]):
                result = await fut
                await asyncio.sleep(args.consume_delay)  # the training step: slower than rollouts
                journal.write("C", result.idempotency_key)
                consumed += 1
                if consumed == args.jobs // 2:
                    await publish_next()
            await asyncio.sleep(3600)  # the scenario kills this process before it gets here
            return 0

        # -- resume: what the restarted trainer recovers ---------------------------------------
        before = Journal.read(journal_path)
        submitted, consumed = before["S"], set(before["C"])
        pending = [k for k in submitted if k not in consumed]
        # Results of the dead process arrive on the durable consumer as unclaimed; let them settle.
        last, stable_since, t0 = -1, time.monotonic(), time.monotonic()
        while time.monotonic() - t0 < 15 and time.monotonic() - stable_since < 1.0:
            n = len(client.unclaimed())
            if n != last:
                last, stable_since = n, time.monotonic()
            await asyncio.sleep(0.05)
        from_consumer = [k for k in pending if k in client.unclaimed()]
        # Results the dead process had received (and acked) but not consumed are not redelivered;
        # `result(key)` alone never sees them. Record that, then recover them by resubmitting.
        acked_unconsumed = [k for k in pending if k not in from_consumer]
        result_api_sees_it = None
        if acked_unconsumed:
            try:
                await client.result(acked_unconsumed[0], timeout=1.0)
                result_api_sees_it = True
            except TimeoutError:
                result_api_sees_it = False
        # Resubmit every pending key: an unclaimed or stored result answers it at once (no new
        # job, the key is a duplicate within the window); a queued job answers it later.
        handles = {}
        for key in pending:
            i = int(key.rsplit("/", 1)[1])
            handles[key] = await client.submit(job_payload(i), min_version=0, idempotency_key=key)
        recovered, lost = {}, []
        for key, handle in handles.items():
            try:
                recovered[key] = await handle.result(30)
            except Exception:
                lost.append(key)
        latest_recovered = client.latest_version
        expected_latest = max(int(v) for v in before["V"]) if before["V"] else None
        next_version = await publish_next()
        await client.wait_for_version(next_version, replicas=args.replicas, timeout=30)
        new = {}
        for i in range(args.jobs // 2):
            key = f"s7/new/{i}"
            new[key] = await client.submit(job_payload(i), min_version=next_version, idempotency_key=key)
        new_done = 0
        for handle in new.values():
            try:
                result = await handle.result(30)
                new_done += int(result.version_start >= next_version)
            except Exception:
                pass
        await asyncio.sleep(0.5)
        summary = {
            "submitted_before": len(submitted),
            "consumed_before": len(consumed),
            "pending": len(pending),
            "from_consumer": len(from_consumer),
            "by_resubmit": len(pending) - len(from_consumer),
            "result_api_sees_acked_unconsumed": result_api_sees_it,
            "recovered": len(recovered),
            "lost": len(lost),
            "duplicated": await ledger.duplicated(),
            "reexecuted": sum(1 for r in recovered.values() if r.delivery_attempt > 1),
            "latest_recovered": latest_recovered,
            "expected_latest": expected_latest,
            "next_version": next_version,
            "new_jobs": len(new),
            "new_jobs_done_at_next_version": new_done,
        }
        print(json.dumps(summary), flush=True)
        return 0
    finally:
        await client.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m reliability.scenarios.procs")
    for flag in ("--nats", "--namespace", "--store", "--base", "--journal"):
        parser.add_argument(flag, required=True)
    parser.add_argument("--client-id", default="trainer")
    parser.add_argument("--phase", choices=["first", "resume"], required=True)
    parser.add_argument("--jobs", type=int, default=60)
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--consume-delay", type=float, default=0.1, help="seconds the loop spends per result")
    args = parser.parse_args(argv)
    return asyncio.run(trainer(args))


if __name__ == "__main__":
    sys.exit(main())
