"""The trainer side of the compose test: submit version-constrained jobs, report who served them.

Used from the host by tests/test_compose_e2e.py (through the broker's published port) and,
unchanged, inside the compose network, where only rollfleet and the standard library exist:

    docker compose run --rm --no-deps -T --entrypoint python worker - \\
        --nats nats://nats:4222 --namespace run1 --jobs 20 --exact-version 1 < tests/compose_trainer.py

prints one JSON object: the results (key, worker, versions, delivery attempt) and the errors.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import uuid
from typing import Any

from rollfleet.schemas import RolloutPayload, SamplingParams
from rollfleet.trainer_client import RolloutClient


def job_payload(i: int) -> RolloutPayload:
    return RolloutPayload(prompt_token_ids=[1 + i % 7, 2, 3], sampling=SamplingParams(max_tokens=4), n=1)


async def submit(
    client: RolloutClient,
    jobs: int,
    *,
    tag: str,
    min_version: int | None = None,
    exact_version: int | None = None,
    timeout: float = 180.0,
) -> list[Any]:
    """Queue ``jobs`` jobs with one version constraint; returns their handles."""
    return [
        await client.submit(
            job_payload(i),
            min_version=min_version,
            exact_version=exact_version,
            idempotency_key=f"{tag}-{i}",
            timeout=timeout,
        )
        for i in range(jobs)
    ]


async def collect(handles: list[Any]) -> dict[str, Any]:
    """Await every handle: {"results": [...], "errors": {key: "Code: message"}}."""
    results, errors = [], {}
    for handle in handles:
        try:
            r = await handle
        except Exception as exc:
            errors[handle.idempotency_key] = f"{type(exc).__name__}: {exc}"
            continue
        results.append(
            {
                "key": r.idempotency_key,
                "worker_id": r.worker_id,
                "version_start": r.version_start,
                "version_end": r.version_end,
                "delivery_attempt": r.delivery_attempt,
                "tokens": len(r.outputs[0].token_ids),
            }
        )
    return {"results": results, "errors": errors}


async def run(args: argparse.Namespace) -> dict[str, Any]:
    client_id = args.client_id or f"compose-trainer-{uuid.uuid4().hex[:8]}"
    async with await RolloutClient.connect(args.nats, namespace=args.namespace, client_id=client_id) as client:
        handles = await submit(
            client,
            args.jobs,
            tag=args.tag or client_id,
            min_version=args.min_version,
            exact_version=args.exact_version,
        )
        return await collect(handles)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nats", required=True)
    p.add_argument("--namespace", required=True)
    p.add_argument("--client-id", default=None)
    p.add_argument("--tag", default=None, help="idempotency key prefix (default: the client id)")
    p.add_argument("--jobs", type=int, default=10)
    group = p.add_mutually_exclusive_group(required=True)
    group.add_argument("--min-version", type=int)
    group.add_argument("--exact-version", type=int)
    out = asyncio.run(run(p.parse_args(argv)))
    print(json.dumps(out), flush=True)
    return 0 if not out["errors"] else 1


if __name__ == "__main__":
    sys.exit(main())
