"""One table of worker defaults (``workers/worker_settings.py``): ``WorkerConfig``, the
``rollfleet worker`` flags and the configuration reference say what it says. Pure, in milliseconds."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from rollfleet.cli.main import _worker_settings, build_parser
from rollfleet.cli.reference import BEGIN, END, marked_block, worker_defaults_markdown
from rollfleet.workers.worker import WorkerConfig
from rollfleet.workers.worker_settings import WORKER_SETTINGS, shown

ROOT = Path(__file__).resolve().parents[1]


def worker_parser() -> argparse.ArgumentParser:
    commands = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return commands.choices["worker"]


def test_worker_config_takes_every_number_and_switch_default_from_the_table() -> None:
    table = {s.field: s.default for s in WORKER_SETTINGS}
    config = {
        f.name: f.default
        for f in dataclasses.fields(WorkerConfig)
        if isinstance(f.default, (bool, int, float)) and f.name != "version"  # (a version is no setting)
    }
    assert config == table
    assert all(type(config[name]) is type(value) for name, value in table.items())
    assert len({s.field for s in WORKER_SETTINGS}) == len(WORKER_SETTINGS)


def test_each_worker_flag_of_a_setting_has_the_table_s_default_and_help() -> None:
    actions = {a.option_strings[0]: a for a in worker_parser()._actions if a.option_strings}
    for s in WORKER_SETTINGS:
        if s.flag is None:
            continue
        action = actions[s.flag]
        assert action.default == s.flag_default, s.flag
        assert action.help is not None and action.help.startswith(s.meaning), s.flag
        if not isinstance(s.default, bool):
            assert action.help.endswith(f"(default {shown(s.flag_default)})"), s.flag
    # A flag written by hand for a WorkerConfig field would carry a default of its own: none may.
    fields = {f.name for f in dataclasses.fields(WorkerConfig)}
    flagged = {s.dest for s in WORKER_SETTINGS if s.flag is not None}
    by_hand = [a for a in actions.values() if {a.dest, f"{a.dest}_s"} & fields and a.dest not in flagged]
    assert "version" in {a.dest for a in by_hand}  # (the check sees flags written by hand)
    assert [(a.dest, a.default) for a in by_hand if isinstance(a.default, (bool, int, float))] == []


def test_each_flag_reaches_its_worker_config_field() -> None:
    given = ["worker", "--capacity", "7", "--heartbeat", "3.5", "--health", "0.25", "--exact-drain", "0"]
    given += ["--checkpoint-tokens", "9", "--checkpoint-s", "0.5", "--follow-versions", "--verify-live"]
    given += ["--prepare-timeout", "11", "--catch-up-wait", "12", "--store", "/tmp/store"]
    config = WorkerConfig(nats_url="nats://x", namespace="n", **_worker_settings(build_parser().parse_args(given)))
    assert (config.capacity, config.heartbeat_s, config.health_s, config.exact_drain_s) == (7, 3.5, 0.25, 0.0)
    assert (config.checkpoint_tokens, config.checkpoint_s, config.prepare_timeout_s) == (9, 0.5, 11.0)
    assert config.follow_versions and config.verify_live and config.catch_up_wait_s == 12.0
    # none given: the table's, and no wait for a first commit without a store to catch up with
    plain = WorkerConfig(nats_url="nats://x", namespace="n", **_worker_settings(build_parser().parse_args(["worker"])))
    assert plain == dataclasses.replace(plain, **{s.field: s.default for s in WORKER_SETTINGS})
    with_store = _worker_settings(build_parser().parse_args(["worker", "--store", "/tmp/store"]))
    assert with_store["catch_up_wait_s"] == 3600.0


def test_the_configuration_reference_is_the_table() -> None:
    # (the reference lives in docs/configuration.md; README.md may hold it instead, never both)
    holders = [p for p in (ROOT / "README.md", ROOT / "docs" / "configuration.md") if BEGIN in p.read_text()]
    assert len(holders) == 1, f"the worker defaults' markers {BEGIN} ... {END} belong in exactly one page"
    block = marked_block(holders[0].read_text())
    assert block == worker_defaults_markdown(), (
        f"{holders[0].name} says other defaults than rollfleet/workers/worker_settings.py: "
        "run python -m rollfleet.cli.reference " + str(holders[0].relative_to(ROOT))
    )


def test_the_reference_shows_every_setting_once_with_its_default() -> None:
    text = worker_defaults_markdown()
    for s in WORKER_SETTINGS:
        (row,) = [line for line in text.splitlines() if line.startswith(f"| `{s.field}` |")]
        assert f"| {shown(s.flag_default)}" in row
    assert shown(4) == "4" and shown(20.0) == "20 s" and shown(0.25) == "0.25 s" and shown(False) == "off"
