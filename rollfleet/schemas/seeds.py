"""Which random stream each sample of a seeded request draws: one rule for every side.

A request seeded ``seed`` with ``n`` samples draws sample ``i`` from the stream
``sample_seed(seed, i) = seed + i`` (vLLM's own rule for its parallel samples, which every
engine follows). So sample ``i`` draws the same stream whether it is sent in one request of
``n``, or alone as a request of one seeded ``sample_seed(seed, i)``: a group split into jobs of
one sample, a partial rollout's continuation, a resumed or segmented job. The workers' engines
and the trainer's rollout loop both read it here (neither may import the other).

A resumable job that samples and gives no seed runs on ``job_seed(job_id)``, on every replica
and in every run of it: a sample continued by another run, or made in segments, keeps one
stream, and the result's replay coordinate names the one seed that made all of it.
"""

from __future__ import annotations

import hashlib
from typing import overload


@overload
def sample_seed(seed: int, index: int) -> int: ...


@overload
def sample_seed(seed: None, index: int) -> None: ...


def sample_seed(seed: int | None, index: int) -> int | None:
    """The seed of sample ``index`` of a request seeded ``seed`` (None: unseeded, stays None)."""
    return None if seed is None else seed + index


def job_seed(job_id: str) -> int:
    """The seed of an unseeded resumable job (62 bits, as a seed an engine draws): derived from
    its job id, so each of its runs, on any replica, draws the same streams, and no other job's."""
    digest = hashlib.blake2b(job_id.encode(), digest_size=8, person=b"rollfleet-seed").digest()
    return int.from_bytes(digest, "little") >> 2
