"""Job ids a client can recognise as its own, also after a restart.

A job id is a random nonce followed by a MAC of (client id, idempotency key, nonce) under a
secret that only this client id's trainers can read (it lives in the sessions bucket, which
no worker may read). Workers learn a job id only with a delivery of that job, so an answer
naming a job id that checks out was produced by a replica the job was delivered to: a replica
cannot forge an answer to a job it never saw, even for a request it could guess, and a
restarted trainer that no longer knows which ids it issued can still tell.

A job given an idempotency key has the same id every time its key is submitted (the nonce is
itself a MAC of the key): a trainer restarted past the broker's duplicate window that submits a
key again stores the same job a second time. While the first copy runs, that job's claim (keyed
by its id) keeps a claimed job's second copy from running; once it is answered, the replica that
pulls the copy finds the job's answer stored (a keyed job is looked up before it runs), runs
nothing, and tells the asker, who reads that answer.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import threading

from rollfleet.broker.buckets import KVBucket
from rollfleet.schemas.errors import BrokerError, Fenced, ServiceUnavailable

_NONCE_HEX = 16
_MAC_HEX = 16
_NONCE_BLOCK = 4096  # random bytes read from the OS at once: nonces for 512 jobs


class _Nonces:
    """Random nonces cut from blocks of ``os.urandom`` (what ``secrets`` reads too): one system
    call per 512 jobs instead of one per job. Each byte is handed out once: under a lock (clients
    on several threads' loops share it), and a forked child starts on a fresh block, so parent
    and child never issue the same nonce."""

    def __init__(self) -> None:
        self._forget()
        os.register_at_fork(after_in_child=self._forget)

    def _forget(self) -> None:
        self._lock = threading.Lock()
        self._block = b""
        self._at = 0

    def hex(self, size: int) -> str:
        with self._lock:
            at = self._at
            if at + size > len(self._block):
                self._block, at = os.urandom(_NONCE_BLOCK), 0
            self._at = at + size
            return self._block[at : at + size].hex()


_nonces = _Nonces()


class JobIds:
    def __init__(self, client_id: str, secret: bytes) -> None:
        self._client = client_id.encode()
        self._secret = secret
        self._key = secret[:64]  # (BLAKE2b's longest key)
        self._head = self._client + b"\x00"  # what every MAC'd message starts with

    @classmethod
    async def load(cls, kv: KVBucket, client_id: str) -> JobIds:
        """This client id's secret, created by its first client (and touched by each one after, so
        the bucket's age limit never removes it while the client id is in use)."""
        key = f"c.{client_id}"
        try:
            found = await kv.read(key)
            secret = b"" if found is None else found.value
            if len(secret) < 16:
                try:
                    secret = secrets.token_bytes(32)
                    await kv.create(key, secret)
                except Fenced:  # created meanwhile: that one
                    secret = (await kv.get(key)).value
            else:
                await kv.put(key, secret)
        except (BrokerError, Fenced) as exc:
            raise ServiceUnavailable(f"cannot read the client's job id secret: {exc}") from exc
        return cls(client_id, secret)

    async def restore(self, kv: KVBucket) -> None:
        """Write this client id's secret back where the broker lost it (a store wiped, or the
        sessions bucket deleted): a restarted trainer, or a re-ask, must recognise the ids issued
        under it. A secret found there already (another client's) is left as it is."""
        try:
            await kv.create(f"c.{self._client.decode()}", self._secret)
        except Fenced:
            pass

    def issue(self, idempotency_key: str | None) -> str:
        """The job id for ``idempotency_key``: the same for every submission of the key by this
        client id; None: a new random id, which becomes the job's key."""
        if idempotency_key is None:
            nonce = _nonces.hex(_NONCE_HEX // 2)
        else:
            nonce = self._mac(idempotency_key, "nonce")
        return nonce + self._mac(idempotency_key, nonce)

    def issued(self, job_id: str | None, idempotency_key: str) -> bool:
        """Whether this client id issued ``job_id`` for ``idempotency_key``."""
        if not job_id or len(job_id) != _NONCE_HEX + _MAC_HEX:
            return False
        nonce, mac = job_id[:_NONCE_HEX], job_id[_NONCE_HEX:]
        # A job submitted without a key has its id as its key: the MAC was made over no key.
        key = None if job_id == idempotency_key else idempotency_key
        return hmac.compare_digest(mac, self._mac(key, nonce))

    def _mac(self, idempotency_key: str | None, nonce: str) -> str:
        msg = self._head + (idempotency_key or "").encode() + b"\x00" + nonce.encode()
        # Keyed BLAKE2b is a MAC by itself (one pass, no HMAC construction): cheap on every job.
        return hashlib.blake2b(msg, key=self._key, digest_size=_MAC_HEX // 2).hexdigest()
