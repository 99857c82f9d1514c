"""Reliability scenario 8 (CI size): hypothesis over every decoder and parser; typed errors only."""

from __future__ import annotations

import pytest

from reliability.scenarios import fuzz

EXAMPLES = 200


@pytest.mark.parametrize("target", sorted(fuzz.DECODERS))
def test_message_decoders_raise_only_typed_errors(target: str) -> None:
    strategy, prop = fuzz.DECODERS[target]
    assert fuzz.run_property(strategy, prop, EXAMPLES) > 0


def test_index_parser_raises_only_typed_errors() -> None:
    assert fuzz.run_property(fuzz.index_inputs, fuzz.prop_index, EXAMPLES) > 0


@pytest.fixture(scope="module")
def version_fixture() -> fuzz.VersionFixture:
    fx = fuzz.VersionFixture()
    yield fx  # type: ignore[misc]
    fx.close()


def test_shard_header_parser_raises_only_typed_errors(version_fixture: fuzz.VersionFixture) -> None:
    strategy = fuzz.st.one_of(fuzz.json_values, fuzz.mutated(fuzz.VALID_HEADER, fuzz.json_values))
    assert fuzz.run_property(strategy, fuzz.header_property(version_fixture), EXAMPLES) > 0


def test_version_opener_on_damaged_directories_raises_only_typed_errors(version_fixture: fuzz.VersionFixture) -> None:
    assert fuzz.run_property(fuzz.damage(), fuzz.version_property(version_fixture), EXAMPLES) > 0


def test_unhashable_dtype_in_a_shard_header_is_a_typed_error(version_fixture: fuzz.VersionFixture) -> None:
    """Regression for the fuzzer's first find: a list as dtype raised TypeError, not CorruptArtifact."""
    doc = {"t": {"dtype": [], "shape": [1], "data_offsets": [0, 1]}}
    fuzz.header_property(version_fixture)(doc)
