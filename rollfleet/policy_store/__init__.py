"""Versioned weight publication in the miles disk-delta / SGLang ``/pull_weights`` format.

Layout (see docs/architecture.md, "A version's life")::

    <store>/weight_v000007/model.safetensors.index.json   metadata + weight_map, written last
    <store>/weight_v000007/model-00000-of-00001.safetensors  one 1-D uint8 zstd frame per changed
                                                             tensor; __metadata__: name -> checksum
    <store>/weight_v000007/rollfleet.json                  our VersionRecord (optional to readers)

Trainer side (``publisher.PolicyPublisher`` wraps these; ``trainer_client`` re-exports it):
    ``writer.write_delta / write_full / link_full`` -- atomic version directories (``write_version_dir``)
    ``retention.apply_retention(store, keep_last)``

Replica / worker side:
    ``materialize(local_dir, store_dir, target_version, *, pre_read_hook=None, workers=N,
        durable=False, store_id=None) -> MaterializeResult`` (version, previous_version, changed,
        applied, reseeded, seeded_from, wire_bytes, changed_bytes, total_bytes, density, seconds).
        Thread- and process-safe (per-host lock). Without ``durable`` the model data is not
        fsynced; the marker carries the boot id and every tensor's checksum, and a marker from an
        earlier boot is re-verified by hashing before it is trusted. The marker also names its
        store: one of another store (or disagreeing with the store's checksums) makes it reseed.
    ``read_marker(local_dir) -> int | None``            the applied-version marker
    ``list_versions(store) -> list[int]``, ``read_record(store, v) -> VersionRecord``,
    ``list_records(store) -> list[VersionRecord]``      plan catch-up from the filesystem alone
    ``verify_version_dir(path, specs=None) -> VersionRecord``  structurally verify a complete
        (possibly foreign, e.g. miles-written) version directory before adopting it
    ``tensor_checksum(data, fmt="xxh3-128") -> str``    the published checksum of raw bytes,
        a numpy array or a torch tensor; compare live engine parameters with the trainer's

Encodings: ``xor`` and ``overwrite`` (miles/SGLang compatible), ``xor_sparse`` (byte-sparse
XOR, read by SGLang's newest puller), ``rf-sparse-xor`` (ours, element-level sparse XOR with byte
planes; foreign readers reject it by name). Full versions may be plain checkpoints (an HF index
without version metadata, or none); every safetensors dtype is sized by bits (``layout``); only
regular files inside the store are read (``files``). ``publisher.publish_checkpoint`` records an
existing checkpoint as a full version (hard links and checksums).
Errors are the typed ``PolicyError`` family from ``rollfleet.schemas.errors``.
"""

from rollfleet.policy_store.formats import (
    CHECKSUM_FORMATS,
    COMPATIBLE_ENCODINGS,
    DELTA_ENCODINGS,
    tensor_checksum,
)
from rollfleet.policy_store.layout import CheckpointLayout, TensorSpec
from rollfleet.policy_store.materialize import MaterializeResult, materialize, read_marker
from rollfleet.policy_store.retention import apply_retention, plan_retention
from rollfleet.policy_store.store import list_records, list_versions, read_record, version_dir_name
from rollfleet.policy_store.verify import verify_version_dir

__all__ = [
    "CHECKSUM_FORMATS",
    "COMPATIBLE_ENCODINGS",
    "DELTA_ENCODINGS",
    "CheckpointLayout",
    "MaterializeResult",
    "TensorSpec",
    "apply_retention",
    "list_records",
    "list_versions",
    "materialize",
    "plan_retention",
    "read_marker",
    "read_record",
    "tensor_checksum",
    "verify_version_dir",
    "version_dir_name",
]
