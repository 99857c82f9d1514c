"""``rollfleet replay``: generate a stored sample again and say whether it came out the same.

It reads a result (``RolloutResult`` as JSON, its replay coordinate included, e.g. written with
``msgspec.json.encode(result)``) and the request it answered (``RolloutPayload`` as JSON), replays
sample ``--index`` through the fleet (``RolloutClient.replay``) and prints the outcome as JSON.
Exit status: 0 matched, 1 diverged or a part of the coordinate differs, 2 an error (a sample that
cannot be replayed is one, ``not_replayable``, with its reason).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import msgspec

from rollfleet.schemas import RolloutPayload, RolloutResult


def add_parser(sub: Any, add_conn: Any) -> None:
    p = sub.add_parser(
        "replay",
        help="generate a stored sample again, deterministic and at its version, and compare it bit for bit",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_conn(p)
    p.add_argument("--result", required=True, help="the result, as JSON (with its replay coordinate)")
    p.add_argument("--payload", required=True, help="the request it answered, as JSON (prompt_token_ids)")
    p.add_argument("--index", type=int, default=0, help="which sample of the result (default %(default)s)")
    p.add_argument("--store", default=None, help="a store directory: compare the version's digest with it too")
    p.add_argument("--client-id", default="replay", help="client id to submit under (default %(default)s)")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for the replay (default %(default)s)")
    p.add_argument("--wait-for-replica", action="store_true", help="queue it until a replica at the version starts")


async def cmd_replay(args: argparse.Namespace, connect_options: dict[str, Any]) -> int:
    from rollfleet.trainer_client import RolloutClient

    result = msgspec.json.decode(Path(args.result).read_bytes(), type=RolloutResult)
    payload = msgspec.json.decode(Path(args.payload).read_bytes(), type=RolloutPayload)
    async with await RolloutClient.connect(
        args.nats, namespace=args.namespace, client_id=args.client_id, **connect_options
    ) as client:
        outcome = await client.replay(
            result,
            payload,
            index=args.index,
            store=args.store,
            timeout=args.timeout,
            wait_for_replica=args.wait_for_replica,
        )
    print(json.dumps(msgspec.to_builtins(outcome), indent=2))
    return 0 if outcome.matched else 1
