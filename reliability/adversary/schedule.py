"""The adversary's event vocabulary and the seeded schedules made of it.

Every event is an ordinary thing that happens to a fleet; the adversary's only trick is when,
and with what else, it happens:

==================  ===========================================================================
``publish``         the trainer publishes and commits the next version (a few tensors change)
``burst``           2-4 versions back to back
``publish_hidden``  the next version is committed while its directory is missing from the
                    store (a flaky mount), and comes back 1-6 s later
``hide``            a committed version's directory disappears for 1-6 s, then comes back
``corrupt``         the next version is committed with a corrupt shard, repaired 2-8 s later
``slow_reads``      every read of the store (the workers' pre-read hook) sleeps 0.5-3 s, for a while
``kill``            SIGKILL a worker: at random, or one holding a session turn, an exact job, a
                    large (chunked) answer, or an at_most_once job older than its claim; restarted
                    under the same id or another one
``term``            SIGTERM a worker (a graceful drain, as ``docker compose --scale`` down does)
``fault``           restart a worker armed with ``ROLLFLEET_FAULT=pause:<point>``, SIGKILL it once
                    it stops there (mid-chunk, mid-drain, mid-prepare, mid-activation, ...)
``broker_restart``  SIGKILL the broker, restart it on its store 0.5-3 s later
``broker_rollback`` the broker's store copied (frozen for the copy: crash-consistent), then 1-6 s
                    later the broker SIGKILLed and restarted 0.5-3 s later on that copy: its last
                    writes lost, as a single node's power loss loses what was never fsynced
``broker_wipe``     SIGKILL the broker, restart it 0.5-3 s later on an empty store (a disk replaced)
``delete_stream``   delete one of the namespace's streams or buckets (``jobs``, ``results``,
                    ``claims``, ``policy``, ``registry``) through the JetStream API while jobs flow
``delete_consumer`` delete a job consumer (``min-<v>``, ``exact-<v>``, ``replica-<id>``) through the
                    JetStream API while jobs flow
``trainer_kill``    SIGKILL the trainer process; it restarts under the same client_id and resumes
``second_client``   a second client connects with the trainer's client_id while it runs
``forge``           the rogue stores forged answers for keys the trainer is likely to use next
``snoop``           the rogue subscribes to every worker inbox for 2-8 s (and copies what it reads)
``pause_worker``    SIGSTOP a worker (at random, or one holding a session turn, an exact job, a
                    large answer or an at_most_once job) for 1.5-6 s, then SIGCONT: frozen, alive
``pause_broker``    SIGSTOP the broker for 1.5-5 s, then SIGCONT (its store and connections kept)
``partition``       one worker's link to the broker stalls (``harness.link``) one way (its
                    messages unheard, or the broker's undelivered) or both, for 1-8 s; bytes are
                    held, as TCP holds them, and delivered when it heals
``lag``             one worker's link adds 50-500 ms to every chunk, for 3-10 s
``cut_link``        one worker's connections to the broker are reset
``skew``            restart a worker (SIGTERM, a graceful drain) with its clocks 0.2-2 s ahead of or
                    behind everyone else's (libfaketime), for the rest of its life: NTP-sized skew
``publisher_kill``  the next version is published by a separate publisher process armed with
                    ``ROLLFLEET_FAULT=kill:<point>`` (a shard written, before or after the rename,
                    before the CAS of ``latest``, before the announcement): SIGKILLed there; the
                    trainer's own publisher goes on 0.5-3 s later
``publisher_race``  two publisher processes race to publish the same next version with different
                    tensors (the trainer's, a perturbed copy; one starts writing 0-50 ms later);
                    one wins, and the trainer's next publish goes on from the winner's bytes
``gateway_kill``    SIGKILL one of the two ``rollfleet gateway`` processes the trainer sends a
                    share of its calls to (over HTTP, keyed); restarted 0.5-3 s later
``gateway_pause``   SIGSTOP one gateway for 1.5-5 s, then SIGCONT (its connections kept, frozen)
``gateway_restart`` SIGTERM one gateway (a rolling restart) and start it again 0.2-2 s later; its
                    HTTP callers' trajectories go on through the other one and then through it
``store_truncate``  (``--store s3``) every response the object store sends one worker (or all) is
                    cut short after 0-64 KiB and its connection closed, for 1-8 s
``store_drop``      (``--store s3``) one worker's (or every worker's) connections to the object
                    store are reset, open and new ones, for 1-6 s
``store_lag``       (``--store s3``) one worker's (or every worker's) object-store link adds
                    50 ms-1 s to every chunk, for 3-10 s
``engine_kill``     SIGKILL the engine server (the keyed SGLang stand-in) an sglang worker is
                    attached to; restarted 0.5-3 s later on its launch checkpoint (version 0's
                    bytes, SGLang's ``default`` label), as a supervisor restarts it
``engine_pause_error`` the engine server answers ``/pause_generation`` with HTTP 500 for 2-8 s,
                    while a version is published (an activation meets the refusal)
``engine_freeze``   SIGSTOP the engine server for 1.5-5 s, then SIGCONT
``disk_full``       a worker's disk full for 2-8 s: its process's RLIMIT_FSIZE set to 0 (``prlimit``),
                    so no file of its may grow (its log file included); at random, or (``preparing``)
                    with a version published meanwhile, which it must prepare on the full disk
``disk_readonly``   a worker's ``--local-dir`` bind-mounted read-only for 2-8 s (EROFS), likewise;
                    skipped, and said, without mount privilege (``reliability.adversary.disks``)
``node_kill``       (``--cluster``) SIGKILL one node of the 3-node cluster (the jobs stream's leader
                    2 times in 3), started again on its store 0.5-6 s later
``node_pause``      (``--cluster``) SIGSTOP one node for 2-10 s, then SIGCONT
``node_cut``        (``--cluster``) one node cut off from the other two for 2-10 s, its clients still
                    connected to it (``reliability.adversary.cluster_nodes``: the relays on its
                    routes hold what it sends)
``autoscaler_*``    (``--autoscale``) the acting ``rollfleet autoscale`` controller SIGKILLed
                    (``_kill``), SIGTERMed (``_restart``), each started again, or frozen
                    (``_pause``); a second one started beside it (``_second``);
                    ``reliability.adversary.autoscaler``
``kill_starting``   (``--autoscale``) a replica SIGKILLed while it starts
``scale_in``        (``--autoscale``) a scale-in during an activation or a resumable job: the
                    controller handed over to one whose maximum is below the fleet's size
``eval_wait``       (``--autoscale``) exact jobs at an old version that wait for a held replica
                    (``wait_for_replica=True``)
==================  ===========================================================================

``make_schedule(seed, duration)`` is a pure function: the same seed gives the same events at
the same offsets with the same parameters (the run itself is real time, so what they meet
varies a little). Pauses are drawn from a stream of their own (``pauses:<seed>``), so adding
them left every other event of a seed's schedule where it was; clock skews and link faults
likewise (``skews:<seed>``, ``links:<seed>``), publisher faults (``publishers:<seed>``) and
gateway faults (``gateways:<seed>``); engine server faults (``engines:<seed>``) are drawn only
with sglang workers (``--sglang N``), whose servers they attack; worker disk faults come from
``disks:<seed>``; the broker's store rolled back or wiped and streams deleted come from
``stores-broker:<seed>`` (``broker_stores``: rare, none in the first 12 s); object-store
faults (``stores:<seed>``, ``object_stores``) are drawn only with
``--store s3``, where every worker reads the bucket through a proxy of its own; autoscaler events
(``autoscalers:<seed>``) only with ``--autoscale``, where controllers size the fleet.
Named schedules script a sequence of the same events.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

FAULT_POINTS = (
    "worker:job-delivered",
    "worker:mid-chunks",
    "worker:after-result-before-ack",
    "worker:after-materialize",
    "worker:before-activation",
    "worker:mid-drain",
    "worker:mid-activation",
)
WEIGHTS = {
    "publish": 4.0,
    "burst": 1.0,
    "publish_hidden": 1.5,
    "hide": 1.0,
    "corrupt": 1.0,
    "slow_reads": 1.0,
    "kill": 3.0,
    "term": 2.0,
    "fault": 2.0,
    "broker_restart": 0.6,
    "delete_consumer": 1.5,
    "trainer_kill": 1.0,
    "second_client": 0.6,
    "forge": 0.8,
    "snoop": 0.6,
}
MEAN_GAP_S = 2.2
KILL_VICTIMS = ("random", "random", "random", "session", "exact", "large", "long")
PAUSE_VICTIMS = ("random", "session", "session-long", "exact", "large", "long")
PAUSE_MEAN_GAP_S = 12.0
TERM_VICTIMS = ("random", "session", "session-long", "exact")
# Where a publisher process is SIGKILLed (reliability.scenarios.policy.PUBLISH_POINTS, scenario 4); the last
# is past the commit boundary (``latest`` moved): that version IS committed, the others are not.
PUBLISHER_KILL_POINTS = (
    "publish:after-shard",
    "publish:before-rename",
    "publish:after-rename",
    "commit:before-cas",
    "commit:before-announce",
)
PUBLISHER_MEAN_GAP_S = 15.0  # a kill or a race every 15 s: about one of each per 30 s
GATEWAY_MEAN_GAP_S = 20.0  # a gateway killed or frozen every 20 s on average
DISK_MEAN_GAP_S = 15.0  # a worker's disk full or read-only every 15 s on average
DISK_KINDS = ("disk_full", "disk_full", "disk_readonly")
DISK_VICTIMS = ("random", "preparing", "preparing")  # preparing: a version is published during the fault
OBJECT_STORE_MEAN_GAP_S = 9.0  # an object-store fault (``--store s3``) every 9 s on average
OBJECT_STORE_KINDS = ("store_truncate", "store_truncate", "store_drop", "store_lag")
ENGINE_MEAN_GAP_S = 10.0  # an engine server killed, refusing pauses or frozen every 10 s on average
STORES_MEAN_GAP_S = 60.0  # the broker's store lost or rolled back, or a stream deleted: rare
STORES_FIRST_S = 12.0  # (never before the fleet has served a while)
STORE_KINDS = ("broker_rollback", "broker_rollback", "broker_wipe", "delete_stream", "delete_stream")
STREAM_TARGETS = ("jobs", "results", "claims", "policy", "registry")  # broker_store.DELETE_TARGETS
NODES_MEAN_GAP_S = 12.0  # (``--cluster``) a node killed, frozen or cut off every 12 s on average
NODE_EVENT_KINDS = ("node_kill", "node_pause", "node_cut", "node_cut")  # cluster_nodes.NODE_KINDS
AUTOSCALER_MEAN_GAP_S = 8.0  # (``--autoscale``) a controller or a scaling event every 8 s on average
AUTOSCALER_EVENT_KINDS = (  # autoscaler.AUTOSCALER_KINDS, weighted
    "autoscaler_kill",
    "autoscaler_restart",
    "autoscaler_pause",
    "autoscaler_second",
    "kill_starting",
    "kill_starting",
    "scale_in",
    "eval_wait",
)


@dataclass
class Event:
    t: float  # seconds after the trainer starts
    kind: str
    params: dict[str, Any] = field(default_factory=dict)


def params_for(kind: str, rng: random.Random, hf: bool) -> dict[str, Any]:
    u = rng.uniform
    if kind == "burst":
        return {"count": rng.randint(2, 4)}
    if kind in ("publish_hidden", "hide"):
        out = {"for_s": round(u(1.0, 6.0), 2)}
        if kind == "hide":
            out["which"] = rng.choice(("latest", "latest", "random"))
        return out
    if kind == "corrupt":
        return {"for_s": round(u(2.0, 8.0), 2)}
    if kind == "slow_reads":
        return {"seconds": round(u(0.5, 3.0), 2), "for_s": round(u(4.0, 12.0), 2)}
    if kind == "kill":
        return {
            "victim": rng.choice(KILL_VICTIMS),
            "restart": rng.random() < 0.85,
            "after": round(u(0.3, 4.0), 2),
            "same_id": rng.random() < 0.75,
            "hf": hf and rng.random() < 0.3,
        }
    if kind == "term":
        return {
            "victim": rng.choice(TERM_VICTIMS),
            "restart": rng.random() < 0.9,
            "after": round(u(0.2, 2.0), 2),
            "same_id": rng.random() < 0.75,
            "hf": hf and rng.random() < 0.3,
        }
    if kind == "fault":
        return {"point": rng.choice(FAULT_POINTS), "hold_s": round(u(0.0, 1.0), 2), "after": round(u(0.3, 2.0), 2)}
    if kind == "broker_restart":
        return {"down_s": round(u(0.5, 3.0), 2)}
    if kind == "delete_consumer":
        return {"which": rng.choice(("latest-min", "latest-min", "latest-exact", "random", "replica"))}
    if kind == "trainer_kill":
        return {"after": round(u(0.3, 3.0), 2), "with_holder": rng.random() < 0.5}
    if kind == "forge":
        return {"count": rng.randint(2, 5)}
    if kind == "snoop":
        return {"for_s": round(u(2.0, 8.0), 2)}
    if kind == "pause_worker":
        return {"victim": rng.choice(PAUSE_VICTIMS), "for_s": round(u(1.5, 6.0), 2)}
    if kind == "pause_broker":
        return {"for_s": round(u(1.5, 5.0), 2)}
    if kind == "partition":
        return {
            "victim": rng.choice(PAUSE_VICTIMS),
            "direction": rng.choice(("up", "down", "both")),
            "for_s": round(u(1.0, 8.0), 2),
        }
    if kind == "lag":
        return {"victim": "random", "seconds": round(u(0.05, 0.5), 3), "for_s": round(u(3.0, 10.0), 2)}
    if kind == "cut_link":
        return {"victim": rng.choice(PAUSE_VICTIMS)}
    if kind == "skew":
        return {"victim": "random", "skew_s": round(rng.choice((-1, 1)) * u(0.2, 2.0), 3)}
    if kind == "publisher_kill":
        return {"point": rng.choice(PUBLISHER_KILL_POINTS), "then_after": round(u(0.5, 3.0), 2)}
    if kind == "publisher_race":
        # (one contender starts writing up to 50 ms after the other: either may win)
        return {
            "salt": rng.randrange(1, 2**31),
            "late": rng.choice(("trainer", "perturbed")),
            "late_s": round(u(0.0, 0.05), 3),
        }
    if kind == "gateway_kill":
        return {"which": rng.randrange(2), "after": round(u(0.5, 3.0), 2)}
    if kind == "gateway_pause":
        return {"which": rng.randrange(2), "for_s": round(u(1.5, 5.0), 2)}
    if kind == "gateway_restart":
        return {"which": rng.randrange(2), "after": round(u(0.2, 2.0), 2)}
    if kind == "broker_rollback":
        return {"lag_s": round(u(1.0, 6.0), 2), "down_s": round(u(0.5, 3.0), 2)}
    if kind == "broker_wipe":
        return {"down_s": round(u(0.5, 3.0), 2)}
    if kind == "delete_stream":
        return {"which": rng.choice(STREAM_TARGETS)}
    if kind in ("disk_full", "disk_readonly"):
        return {"victim": rng.choice(DISK_VICTIMS), "for_s": round(u(2.0, 8.0), 2)}
    return {}


def random_schedule(
    seed: int,
    duration: float,
    hf: bool = False,
    sglang: bool = False,
    store: str = "dir",
    cluster: bool = False,
    autoscale: bool = False,
) -> list[Event]:
    rng = random.Random(f"schedule:{seed}")
    kinds, weights = zip(*WEIGHTS.items(), strict=True)
    events: list[Event] = []
    t = rng.uniform(1.5, 3.5)
    trainer_kills = 0
    while t < duration - 2.0:
        kind = rng.choices(kinds, weights)[0]
        if kind == "trainer_kill" and (trainer_kills >= 2 or t > duration - 8.0):
            kind = "publish"
        trainer_kills += kind == "trainer_kill"
        events.append(Event(round(t, 2), kind, params_for(kind, rng, hf)))
        t += rng.expovariate(1.0 / MEAN_GAP_S)
    more: list[Event] = []
    for stream in STREAMS:
        if stream.drawn(sglang, store, cluster, autoscale):
            more += stream.draw(seed, duration)
    return sorted(events + more, key=lambda e: e.t)


def object_store_params(kind: str, rng: random.Random) -> dict[str, Any]:
    """An object-store fault's parameters (``victim``: a worker at random, or ``all`` of them)."""
    u = rng.uniform
    victim = rng.choice(("random", "random", "all"))
    if kind == "store_truncate":
        # 0 B: closed before the status line (the client's own retries see it); 300 B: inside the
        # headers; larger: inside a shard's body, which the reader must never take for whole.
        return {"victim": victim, "bytes": rng.choice((0, 300, 4096, 65536)), "for_s": round(u(1.0, 8.0), 2)}
    if kind == "store_drop":
        return {"victim": victim, "for_s": round(u(1.0, 6.0), 2)}
    return {"victim": victim, "seconds": round(u(0.05, 1.0), 3), "for_s": round(u(3.0, 10.0), 2)}  # store_lag


def engine_params(kind: str, rng: random.Random) -> dict[str, Any]:
    """An engine event's parameters (``which``: the index among the live sglang workers)."""
    u = rng.uniform
    if kind == "engine_kill":
        return {"which": rng.randrange(2), "after": round(u(0.5, 3.0), 2)}
    if kind == "engine_pause_error":
        return {"which": rng.randrange(2), "for_s": round(u(2.0, 8.0), 2), "publish": True}
    return {"which": rng.randrange(2), "for_s": round(u(1.5, 5.0), 2)}  # engine_freeze


def autoscaler_params(kind: str, rng: random.Random) -> dict[str, Any]:
    """An autoscaler event's parameters (``reliability.adversary.autoscaler``)."""
    u = rng.uniform
    if kind in ("autoscaler_kill", "autoscaler_restart"):
        return {"after": round(u(0.3, 3.0), 2)}
    if kind == "autoscaler_pause":
        return {"for_s": round(u(2.0, 10.0), 2)}  # (past half a lease time, 3 s, it must stop acting)
    if kind == "autoscaler_second":
        return {"for_s": round(u(5.0, 20.0), 2)}
    if kind == "kill_starting":
        return {"after": round(u(0.2, 1.5), 2)}
    if kind == "scale_in":
        return {"during": rng.choice(("activation", "resume")), "for_s": round(u(3.0, 6.0), 2), "slow_s": 2.0}
    hide = {"hide_s": round(u(1.0, 4.0), 2)} if rng.random() < 0.3 else {}  # (its version unreadable a moment)
    return {"back": rng.randint(1, 3), "count": rng.randint(1, 3), "deadline_s": 40.0, **hide}  # eval_wait


def node_params(kind: str, rng: random.Random) -> dict[str, Any]:
    """A node event's parameters (``which``: the jobs stream's leader, or a node at random)."""
    which = rng.choice(("leader", "leader", "random"))
    if kind == "node_kill":
        return {"which": which, "down_s": round(rng.uniform(0.5, 6.0), 2)}
    return {"which": which, "for_s": round(rng.uniform(2.0, 10.0), 2)}


def _params(kind: str, rng: random.Random) -> dict[str, Any]:
    return params_for(kind, rng, False)


@dataclass(frozen=True)
class EventStream:
    """Events of a few kinds drawn from a random stream of their own (``<name>:<seed>``), so that
    adding a stream (or a kind to one) leaves every other event of a seed where it was: the first
    at ``first(rng, duration)``, then one every ``mean_gap_s`` on average (exponential gaps) or,
    with ``gap``, as it draws; none in the last ``margin_s``. ``only``: drawn only in that mode
    (``sglang``: where a worker has an engine server of its own to attack; ``s3``: where workers
    read an object store through fault proxies; ``cluster``: where the broker is three nodes;
    ``autoscale``: where controllers size the fleet)."""

    name: str
    kinds: tuple[str, ...]
    first: Callable[[random.Random, float], float]
    margin_s: float
    mean_gap_s: float = 0.0
    gap: Callable[[random.Random], float] | None = None
    params: Callable[[str, random.Random], dict[str, Any]] = _params
    only: str | None = None

    def drawn(self, sglang: bool, store: str, cluster: bool, autoscale: bool = False) -> bool:
        """Whether a run in this mode draws this stream."""
        modes = {"sglang": sglang, "s3": store == "s3", "cluster": cluster, "autoscale": autoscale}
        return self.only is None or modes[self.only]

    def draw(self, seed: int, duration: float) -> list[Event]:
        rng = random.Random(f"{self.name}:{seed}")
        out: list[Event] = []
        t = self.first(rng, duration)
        while t < duration - self.margin_s:
            kind = self.kinds[0] if len(self.kinds) == 1 else rng.choice(self.kinds)
            out.append(Event(round(t, 2), kind, self.params(kind, rng)))
            t += self.gap(rng) if self.gap is not None else rng.expovariate(1.0 / self.mean_gap_s)
        return out


def _uniform(lo: float, hi: float) -> Callable[[random.Random, float], float]:
    return lambda rng, _duration: rng.uniform(lo, hi)


# The seed's side streams, in the order they are drawn (each from its own random stream).
STREAMS: tuple[EventStream, ...] = (
    # Worker and broker pauses (SIGSTOP/SIGCONT).
    EventStream("pauses", ("pause_worker", "pause_worker", "pause_broker"), _uniform(4.0, 10.0), 4.0, PAUSE_MEAN_GAP_S),
    # Workers restarted with skewed clocks: one in the first half of a run, another per further 60 s.
    EventStream(
        "skews",
        ("skew",),
        lambda rng, duration: rng.uniform(3.0, max(3.5, duration / 2)),
        6.0,
        gap=lambda rng: rng.uniform(45.0, 75.0),
    ),
    # Faults on one worker's link to the broker.
    EventStream("links", ("partition", "partition", "lag", "cut_link"), _uniform(4.0, 12.0), 4.0, 14.0),
    # Publisher processes SIGKILLed mid-publication, or racing for one version.
    EventStream("publishers", ("publisher_kill", "publisher_race"), _uniform(5.0, 15.0), 6.0, PUBLISHER_MEAN_GAP_S),
    # Gateway processes SIGKILLed (and restarted), frozen, or restarted gracefully.
    EventStream(
        "gateways", ("gateway_kill", "gateway_pause", "gateway_restart"), _uniform(3.0, 12.0), 4.0, GATEWAY_MEAN_GAP_S
    ),
    # Engine servers killed (restarted on their launch checkpoint), refusing pauses, or frozen.
    EventStream(
        "engines",
        ("engine_kill", "engine_kill", "engine_pause_error", "engine_freeze"),
        _uniform(4.0, 10.0),
        4.0,
        ENGINE_MEAN_GAP_S,
        params=engine_params,
        only="sglang",
    ),
    # Faults between the workers and the object store.
    EventStream(
        "stores",
        OBJECT_STORE_KINDS,
        _uniform(3.0, 8.0),
        4.0,
        OBJECT_STORE_MEAN_GAP_S,
        params=object_store_params,
        only="s3",
    ),
    # A worker's own disk full or read-only for a while.
    EventStream("disks", DISK_KINDS, _uniform(4.0, 12.0), 6.0, DISK_MEAN_GAP_S),
    # The broker's store rolled back or wiped, or a stream or bucket deleted: rare (one per minute
    # on average), and never before the fleet has served a while.
    EventStream(
        "stores-broker",
        STORE_KINDS,
        lambda rng, _duration: STORES_FIRST_S + rng.expovariate(1.0 / STORES_MEAN_GAP_S),
        6.0,
        STORES_MEAN_GAP_S,
    ),
    # A cluster's node killed, frozen or cut off from the other two (the leader of the jobs
    # stream more often than not).
    EventStream(
        "nodes", NODE_EVENT_KINDS, _uniform(5.0, 10.0), 6.0, NODES_MEAN_GAP_S, params=node_params, only="cluster"
    ),
    # (``--autoscale``) the controllers killed, restarted, frozen or doubled; a replica killed while
    # it starts; scale-ins during activations and resumable jobs; evaluations waiting for a held
    # replica.
    EventStream(
        "autoscalers",
        AUTOSCALER_EVENT_KINDS,
        _uniform(4.0, 8.0),
        6.0,
        AUTOSCALER_MEAN_GAP_S,
        params=autoscaler_params,
        only="autoscale",
    ),
)
STREAM_BY_NAME = {s.name: s for s in STREAMS}
# Each stream by the name its events go by (``pauses(seed, duration)``: that seed's pauses).
pauses = STREAM_BY_NAME["pauses"].draw
skews = STREAM_BY_NAME["skews"].draw
links = STREAM_BY_NAME["links"].draw
publishers = STREAM_BY_NAME["publishers"].draw
gateways = STREAM_BY_NAME["gateways"].draw
engines = STREAM_BY_NAME["engines"].draw
object_stores = STREAM_BY_NAME["stores"].draw
disks = STREAM_BY_NAME["disks"].draw
broker_stores = STREAM_BY_NAME["stores-broker"].draw
nodes = STREAM_BY_NAME["nodes"].draw
autoscalers = STREAM_BY_NAME["autoscalers"].draw


# -- named schedules: scripted sequences of the same events ------------------------------------------


def _drain_and_flaky_mount(duration: float, rng: random.Random, hf: bool) -> list[Event]:
    """Slow reads while a version is prepared, the next one committed meanwhile while its
    directory is missing (a flaky mount), then a delta that changes other tensors; later a
    corrupt shard in the same position, and a replica killed mid-drain."""
    out = [Event(3.0, "publish"), Event(7.0, "slow_reads", {"seconds": 1.5, "for_s": 5.0}), Event(7.5, "publish")]
    out += [Event(8.0, "publish_hidden", {"for_s": 6.0}), Event(16.0, "publish")]
    out += [Event(20.0, "fault", {"point": "worker:mid-drain", "hold_s": 0.3, "after": 1.0})]
    out += [Event(24.0, "slow_reads", {"seconds": 1.0, "for_s": 4.0}), Event(24.5, "publish")]
    out += [Event(25.0, "corrupt", {"for_s": 5.0}), Event(31.0, "publish")]
    return [e for e in out if e.t < duration - 2.0]


def _sessions_and_trainer(duration: float, rng: random.Random, hf: bool) -> list[Event]:
    """The trainer SIGKILLed while a replica runs one of its session turns, that replica SIGKILLed
    for good, the trainer back under the same id resuming its sessions; replicas stopped
    gracefully (SIGTERM) while they run a long turn; failed turns asked again."""
    term = {"victim": "session-long", "restart": True, "after": 0.5, "same_id": True, "hf": False}
    out = [Event(4.0, "publish"), Event(6.0, "trainer_kill", {"after": 1.0, "with_holder": True})]
    out += [Event(12.0, "term", term), Event(16.0, "publish"), Event(17.0, "burst", {"count": 3})]
    out += [Event(20.0, "term", term), Event(22.0, "trainer_kill", {"after": 0.5, "with_holder": True})]
    return [e for e in out if e.t < duration - 2.0]


def _chunks_and_consumers(duration: float, rng: random.Random, hf: bool) -> list[Event]:
    """Large answers cut mid-chunk and re-run at another version; job consumers deleted while
    jobs flow; the broker restarted; a rogue forging answers."""
    out = [Event(3.0, "fault", {"point": "worker:mid-chunks", "hold_s": 0.2, "after": 0.5}), Event(5.0, "publish")]
    out += [Event(9.0, "delete_consumer", {"which": "latest-min"}), Event(12.0, "forge", {"count": 5})]
    out += [Event(12.5, "snoop", {"for_s": 4.0})]
    out += [Event(14.0, "kill", {"victim": "large", "restart": True, "after": 1.0, "same_id": False, "hf": False})]
    out += [Event(15.0, "publish"), Event(18.0, "delete_consumer", {"which": "latest-exact"})]
    out += [Event(21.0, "broker_restart", {"down_s": 1.5}), Event(25.0, "second_client")]
    return [e for e in out if e.t < duration - 2.0]


def _long_at_most_once(duration: float, rng: random.Random, hf: bool) -> list[Event]:
    """An at_most_once job that outlives its claim, its holder SIGKILLed after that."""
    kill = {"victim": "long", "restart": True, "after": 0.5, "same_id": True, "hf": False}
    out = [Event(5.0, "publish"), Event(18.0, "kill", kill), Event(32.0, "kill", kill), Event(40.0, "publish")]
    return [e for e in out if e.t < duration - 2.0]


def _pauses(duration: float, rng: random.Random, hf: bool) -> list[Event]:
    """Workers frozen (SIGSTOP) for seconds while they hold a session turn, an exact job or a long
    turn; the broker frozen while jobs run (issue 30, items 8 and 9)."""
    out = [Event(4.0, "publish"), Event(6.0, "pause_worker", {"victim": "session", "for_s": 5.0})]
    out += [Event(14.0, "pause_broker", {"for_s": 4.0}), Event(19.0, "publish")]
    out += [Event(20.0, "pause_worker", {"victim": "session-long", "for_s": 5.0})]
    out += [Event(27.0, "pause_worker", {"victim": "exact", "for_s": 4.0}), Event(29.0, "pause_broker", {"for_s": 3.0})]
    return [e for e in out if e.t < duration - 2.0]


def _publishers(duration: float, rng: random.Random, hf: bool) -> list[Event]:
    """Publisher processes SIGKILLed at each stage of a publication (before and after the commit
    boundary) and two races for one version (the trainer's contender starting first, then the
    perturbed one's), each followed by an ordinary publish."""
    race = {"salt": rng.randrange(1, 2**31), "late": "perturbed", "late_s": 0.02}
    out = [Event(3.0, "publish"), Event(5.0, "publisher_race", race), Event(8.0, "publish")]
    t = 11.0
    for point in PUBLISHER_KILL_POINTS:
        out.append(Event(t, "publisher_kill", {"point": point, "then_after": 1.5}))
        t += 5.0
    race = {"salt": rng.randrange(1, 2**31), "late": "trainer", "late_s": 0.02}
    out += [Event(t, "publisher_race", race), Event(t + 3.0, "publish")]
    return [e for e in out if e.t < duration - 2.0]


def _broker_stores(duration: float, rng: random.Random, hf: bool) -> list[Event]:
    """The broker's store rolled back (its last seconds of writes lost), a stream and a bucket
    deleted while jobs flow, then the store wiped, each with publishes around it."""
    out = [Event(3.0, "publish"), Event(6.0, "publish"), Event(8.0, "broker_rollback", {"lag_s": 3.0, "down_s": 1.0})]
    out += [Event(15.0, "publish"), Event(18.0, "delete_stream", {"which": rng.choice(("jobs", "results"))})]
    out += [Event(24.0, "delete_stream", {"which": rng.choice(("claims", "policy", "registry"))})]
    out += [Event(27.0, "publish"), Event(31.0, "broker_wipe", {"down_s": 1.0}), Event(36.0, "publish")]
    return [e for e in out if e.t < duration - 2.0]


def _engines(duration: float, rng: random.Random, hf: bool) -> list[Event]:
    """(With ``--sglang 1``.) The sglang replica's server refuses pauses for 9 s while a version is
    published (its activation fails, and is retried with a growing backoff, while the version sits
    materialized in the replica's checkpoint directory); SIGKILLed late in that window, it comes
    back on its launch checkpoint before the retry; later frozen, and killed again."""
    out = [Event(3.0, "publish"), Event(6.0, "engine_pause_error", {"which": 0, "for_s": 9.0, "publish": True})]
    out += [Event(12.5, "engine_kill", {"which": 0, "after": 0.5}), Event(20.0, "publish")]
    out += [Event(23.0, "engine_freeze", {"which": 0, "for_s": 3.0})]
    out += [Event(28.0, "engine_kill", {"which": 0, "after": 1.0})]
    return [e for e in out if e.t < duration - 2.0]


def _autoscaler(duration: float, rng: random.Random, hf: bool) -> list[Event]:
    """(Implies ``--autoscale 3:5``.) The echo fleet sized by ``rollfleet autoscale`` controllers: an
    evaluation of an old version waiting for a held replica; a replica killed while it starts; the
    acting controller SIGKILLed and started again while a second one starts beside it (one of them
    takes the lapsed lease); the acting one frozen past its lease (the other takes over, and the
    frozen one must not act when it thaws); a broker restart under them; a scale-in during an
    activation, then one during resumable jobs (each hands the controller over twice: clean
    restarts); another replica killed while it starts; last, an evaluation of a version whose
    directory is unreadable for a moment as it is asked for."""
    wait = {"count": 2, "deadline_s": 40.0}
    out = [Event(3.0, "publish"), Event(5.0, "eval_wait", {"back": 2, **wait})]
    out += [Event(7.0, "kill_starting", {"after": round(rng.uniform(0.3, 1.2), 2)}), Event(9.0, "publish")]
    out += [Event(10.0, "autoscaler_kill", {"after": 1.0}), Event(13.0, "autoscaler_second", {"for_s": 20.0})]
    out += [Event(22.0, "autoscaler_pause", {"for_s": 9.0}), Event(26.0, "eval_wait", {"back": 3, **wait})]
    out += [Event(28.0, "publish"), Event(31.0, "broker_restart", {"down_s": 2.0})]
    out += [Event(34.0, "scale_in", {"during": "activation", "for_s": 4.0, "slow_s": 2.0})]
    out += [Event(38.0, "scale_in", {"during": "resume", "for_s": 4.0}), Event(50.0, "kill_starting", {"after": 0.5})]
    # Last, with no controller event after it (it waits for the scale-ins): its version unreadable
    # for 3 s as it is asked for, back long before the deadline.
    out += [Event(53.0, "eval_wait", {"back": 1, "count": 2, "deadline_s": 30.0, "hide_s": 3.0})]
    return [e for e in out if e.t < duration - 2.0]


SCHEDULES: dict[str, Callable[[float, random.Random, bool], list[Event]]] = {
    "drain-flaky-mount": _drain_and_flaky_mount,
    "sessions-trainer": _sessions_and_trainer,
    "chunks-consumers": _chunks_and_consumers,
    "long-at-most-once": _long_at_most_once,
    "pauses": _pauses,
    "publishers": _publishers,
    "engines": _engines,  # (with --sglang 1)
    "broker-stores": _broker_stores,
    "autoscaler": _autoscaler,  # (implies --autoscale 3:5)
}


def make_schedule(
    seed: int,
    duration: float,
    hf: bool = False,
    name: str | None = None,
    sglang: bool = False,
    store: str = "dir",
    cluster: bool = False,
    autoscale: bool = False,
) -> list[Event]:
    if name and name in SCHEDULES:
        return SCHEDULES[name](duration, random.Random(f"schedule:{seed}"), hf)
    if name and name != "no-auth":
        raise ValueError(f"unknown schedule {name!r}; named schedules: {', '.join(SCHEDULES)}")
    return random_schedule(seed, duration, hf, sglang=sglang, store=store, cluster=cluster, autoscale=autoscale)
