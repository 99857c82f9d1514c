"""The adversary's object store (``--store s3``): a real S3 API (moto's server) holding the policy
store, the trainer's publishers writing to it directly, and every worker reading it through a
fault proxy of its own (``harness.link.LinkProxy``: truncate, drop, lag).

One proxy per worker, as for the broker links: a fault can hit one replica (its downloads cut
short while the others' are whole, so the fleet splits across versions) or all of them (each
proxy at once: the store itself failing). The directory mode's damage has its bucket form here:
a hidden version is one whose index object is deleted (the commit boundary inside a bucket: an
index-less version is not listed) and put back byte for byte; a corrupt shard is its pinned
object overwritten with flipped bytes of the same size, then restored. The harness talks to moto
directly (boto3), never through a proxy.
"""

from __future__ import annotations

from pathlib import Path, PurePosixPath
from typing import Any

from harness.link import LinkProxy
from rollfleet.cli.local_s3 import BUCKET, S3Server

PREFIX = "adv"  # the policy store: s3://rollfleet-weights/adv
INDEX = "model.safetensors.index.json"


class ObjectStore:
    """moto, the bucket's URL, and one proxy per worker id between that worker and moto."""

    def __init__(self, workdir: Path) -> None:
        self.server = S3Server(Path(workdir) / "s3")
        self.proxies: dict[str, LinkProxy] = {}
        self.hidden: dict[int, bytes] = {}  # version -> its index object's bytes, while it is deleted

    @property
    def url(self) -> str:
        return self.server.url(PREFIX)

    def start(self) -> ObjectStore:
        self.server.start()
        return self

    async def start_proxies(self, worker_ids: list[str]) -> None:
        for wid in worker_ids:
            self.proxies[wid] = await LinkProxy("127.0.0.1", self.server.port).start()

    def env(self) -> dict[str, str]:
        """What a process that writes or reads the bucket directly needs (credentials, endpoint)."""
        return self.server.env()

    def worker_env(self, worker_id: str) -> dict[str, str]:
        """A worker's: the same credentials, its own proxy as the endpoint."""
        env = self.server.env()
        proxy = self.proxies.get(worker_id)
        if proxy is not None:
            env["AWS_ENDPOINT_URL"] = f"http://127.0.0.1:{proxy.port}"
        return env

    def targets(self, victim: str) -> list[LinkProxy]:
        """The proxies a fault hits: one worker's, or every one (``all``)."""
        if victim == "all":
            return list(self.proxies.values())
        return [self.proxies[victim]] if victim in self.proxies else []

    # -- damage, through moto directly --------------------------------------------------------------
    def _key(self, version: int, name: str = "") -> str:
        return f"{PREFIX}/weight_v{version:06d}/{name}"

    def hide(self, version: int) -> bool:
        """Delete ``version``'s index object (it stops being listed); False if it has none."""
        s3 = self.server.client()
        try:
            body = s3.get_object(Bucket=BUCKET, Key=self._key(version, INDEX))["Body"].read()
        except s3.exceptions.NoSuchKey:
            return False
        self.hidden[version] = body
        s3.delete_object(Bucket=BUCKET, Key=self._key(version, INDEX))
        return True

    def unhide(self, version: int) -> None:
        body = self.hidden.pop(version, None)
        if body is not None:
            self.server.client().put_object(Bucket=BUCKET, Key=self._key(version, INDEX), Body=body)

    def corrupt(self, version: int, rng: Any) -> tuple[PurePosixPath, bytes] | None:
        """Flip 16 bytes in the middle of one shard object of ``version`` (same size: its listing
        still matches the pin, only the bytes differ); returns what to restore."""
        s3 = self.server.client()
        listed = s3.list_objects_v2(Bucket=BUCKET, Prefix=self._key(version)).get("Contents", [])
        shards = sorted(o["Key"] for o in listed if o["Key"].endswith(".safetensors") and o["Size"] > 64)
        if not shards:
            return None
        key = rng.choice(shards)
        original = s3.get_object(Bucket=BUCKET, Key=key)["Body"].read()
        data = bytearray(original)
        at = len(data) // 2 + rng.randrange(max(1, len(data) // 4))
        for i in range(at, min(len(data), at + 16)):
            data[i] ^= 0xA5
        s3.put_object(Bucket=BUCKET, Key=key, Body=bytes(data))
        return PurePosixPath(key), original

    def restore(self, key: PurePosixPath, original: bytes) -> None:
        self.server.client().put_object(Bucket=BUCKET, Key=str(key), Body=original)

    def heal(self) -> None:
        for v in list(self.hidden):
            self.unhide(v)
        for proxy in self.proxies.values():  # (an event cancelled mid-fault leaves none behind)
            proxy.heal()

    def versions(self) -> list[int]:
        """Published versions (with an index object), as a fresh publisher would list them."""
        s3 = self.server.client()
        out: set[int] = set()
        for page in s3.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=f"{PREFIX}/"):
            for o in page.get("Contents", []):
                parts = o["Key"].split("/")
                if len(parts) == 3 and parts[2] == INDEX and parts[1].startswith("weight_v"):
                    out.add(int(parts[1].removeprefix("weight_v")))
        return sorted(out)

    async def close(self) -> None:
        for proxy in self.proxies.values():
            await proxy.close()
        self.server.stop()


# -- the promise: replicas converge once the store is whole (the oracle's ``converged``) ----------

CONVERGE_S = 20.0  # a failed version's retries (2, 4, 8, 16 s apart), one more attempt and a drain


def heal_moments(windows: list[tuple[float, float]], horizon: float, bound: float) -> tuple[list[float], int]:
    """The moments the store was whole again (the end of each merged stretch of store faults)
    that a quiet ``bound`` follows (no other fault begins, and the run watched it to its end,
    ``horizon``); and how many were not, which cannot be judged."""
    merged: list[list[float]] = []
    for a, b in sorted(windows):
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    out, skipped = [], 0
    for i, (_, end) in enumerate(merged):
        following = merged[i + 1][0] if i + 1 < len(merged) else float("inf")
        if following < end + bound or end + bound > horizon:
            skipped += 1
        else:
            out.append(end)
    return out, skipped


def converged_by(entries: list[tuple[float, int]], latest: int, deadline: float) -> tuple[bool | None, int | None]:
    """Whether one replica process's registry entries (time, active version) show it at ``latest``
    or newer by ``deadline``: True; False where an entry near the deadline (its heartbeat) still
    shows an older one; None where none was seen near it (unknown, not passed). With the version
    it showed last."""
    seen = sorted((t, v) for t, v in entries if t <= deadline)
    if any(v >= latest for _, v in seen):
        return True, max(v for _, v in seen)
    if not seen or seen[-1][0] < deadline - 3.0:
        return None, seen[-1][1] if seen else None
    return False, seen[-1][1]


# -- the adversary's side: set-up and the events (``Adversary`` calls these; kept here so that the
# shared adversary module carries one line per hook) ---------------------------------------------

STORE_FAULT_KINDS = ("store_truncate", "store_drop", "store_lag")
_SAVED_ENV = "_rf_adv_saved_env"


async def start_object_store(adv: Any, worker_ids: list[str]) -> ObjectStore:
    """moto and a proxy per worker id; the adversary's own publisher reads the bucket's
    credentials and endpoint from this process's environment (restored by ``close_object_store``)."""
    import asyncio
    import os

    store = await asyncio.to_thread(ObjectStore(adv.workdir).start)
    await store.start_proxies(worker_ids)
    saved = {k: os.environ.get(k) for k in store.env()}
    setattr(store, _SAVED_ENV, saved)
    os.environ.update(store.env())
    adv.machine.objstore = store
    adv.say("object store", url=store.url, endpoint=store.server.endpoint, proxies=len(store.proxies))
    return store


async def close_object_store(adv: Any) -> None:
    import os

    store = adv.machine.objstore
    if store is None:
        return
    for k, v in getattr(store, _SAVED_ENV, {}).items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    await store.close()


async def store_event(adv: Any, kind: str, p: dict[str, Any]) -> bool:
    """One object-store fault on one worker's proxy (a live worker at random) or on every one
    (``all``), for ``for_s`` seconds; recorded in ``Timeline.store_faults`` for the oracle."""
    import asyncio
    import time

    m = adv.machine
    store: ObjectStore | None = m.objstore
    if store is None:
        adv.say(f"{kind} skipped", reason="the policy store is a directory (only --store s3 has a proxy)")
        return False
    if p["victim"] == "all":
        ids = sorted(store.proxies)
    else:
        live = [w.worker_id for w in m.alive_workers() if w.worker_id in store.proxies]
        if not live:
            adv.say(f"{kind} skipped", reason="no victim")
            return False
        ids = [adv.rng.choice(sorted(live))]
    proxies = [store.proxies[w] for w in ids]
    t0 = time.time()
    if kind == "store_truncate":
        adv.say("store truncating", workers=ids, bytes=p["bytes"], for_s=p["for_s"])
        await asyncio.gather(*(px.truncate(p["bytes"], p["for_s"]) for px in proxies))
    elif kind == "store_drop":
        adv.say("store dropping", workers=ids, for_s=p["for_s"])
        await asyncio.gather(*(px.drop(p["for_s"]) for px in proxies))
    else:
        adv.say("store lagging", workers=ids, seconds=p["seconds"], for_s=p["for_s"])
        await asyncio.gather(*(px.lag(p["seconds"], p["for_s"]) for px in proxies))
    m.timeline.store_faults.append({"kind": kind, "workers": ids, "from": t0, "to": time.time(), **p})
    adv.say("store whole again", kind=kind, workers=ids)
    return True


async def watch_after_heal(adv: Any) -> None:
    """Keep the run going (the tap listening) until ``CONVERGE_S`` after the store was last whole
    again, so the oracle's ``converged`` can judge the last heal too (at most that long)."""
    import asyncio
    import time

    tl = adv.machine.timeline
    if adv.machine.objstore is None:
        return
    ends = [float(f["to"]) for f in tl.store_faults] + [float(b) for _, _, b in [*tl.hidden, *tl.corrupt]]
    until = max(ends, default=0.0) + CONVERGE_S + 1.5
    if until > time.time():
        adv.say("watching the replicas converge", for_s=round(until - time.time(), 1))
        await asyncio.sleep(min(CONVERGE_S + 1.5, until - time.time()))
