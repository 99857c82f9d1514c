"""What a bucket index pins, judged from the index alone (no server): a bucket version is exactly
the objects its index pins, by size and blake3, or it is refused with a typed error."""

from __future__ import annotations

import pytest

from rollfleet.policy_store.bucket import OBJECTS_KEY, Pin, pin_objects, pinned_files
from rollfleet.schemas.errors import CorruptArtifact, HostileName
from rollfleet.schemas.index import IndexMetadata, PublicationIndex

PREFIX = ".upload-0123456789abcdef"
SUM = "ab" * 32  # a blake3 hex digest's shape


def _index(pins: object) -> PublicationIndex:
    extra = {} if pins is None else {OBJECTS_KEY: pins}
    return PublicationIndex(IndexMetadata(version=3, extra=extra), {"w": "model.safetensors"})


def test_the_pins_a_publisher_writes_are_what_a_reader_reads() -> None:
    pins = pin_objects(PREFIX, {"model.safetensors": (10, SUM), "rollfleet.json": (2, SUM.upper())})
    assert pinned_files(_index(pins), "v3") == {
        "model.safetensors": Pin(f"{PREFIX}/model.safetensors", 10, SUM),
        "rollfleet.json": Pin(f"{PREFIX}/rollfleet.json", 2, SUM),
    }


def _with(**change: object) -> dict:
    pins = pin_objects(PREFIX, {"model.safetensors": (10, SUM)})
    pins.update(change)
    return pins


@pytest.mark.parametrize(
    "pins",
    [
        None,  # another tool's upload, or an older rollfleet's: nothing says which bytes are the version
        _with(prefix="../elsewhere"),
        _with(prefix=".upload-XYZ"),
        _with(checksum_format="adler32"),
        _with(files={"model.safetensors": {"size": -1, "checksum": SUM}}),
        _with(files={"model.safetensors": {"size": True, "checksum": SUM}}),
        _with(files={"model.safetensors": {"size": 10, "checksum": "abc"}}),
        _with(files={"model.safetensors.index.json": {"size": 1, "checksum": SUM}}),
        _with(files={"other.safetensors": {"size": 10, "checksum": SUM}}),  # the weight_map's shard unpinned
    ],
)
def test_an_index_that_does_not_pin_its_version_is_corrupt(pins: object) -> None:
    with pytest.raises(CorruptArtifact):
        pinned_files(_index(pins), "v3")


def test_a_hostile_pinned_name_is_refused() -> None:
    pins = _with(files={"model.safetensors": {"size": 1, "checksum": SUM}, "../x": {"size": 1, "checksum": SUM}})
    with pytest.raises(HostileName):
        pinned_files(_index(pins), "v3")
