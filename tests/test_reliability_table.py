"""The invariant/event table of docs/reliability.md stays true: every invariant the oracle
judges has a row, every event kind the adversary can draw has a column (milliseconds)."""

from __future__ import annotations

import random
import re
from pathlib import Path

from reliability.adversary.schedule import (
    AUTOSCALER_EVENT_KINDS,
    WEIGHTS,
    autoscalers,
    broker_stores,
    disks,
    engine_params,
    engines,
    gateways,
    links,
    node_params,
    nodes,
    object_store_params,
    object_stores,
    params_for,
    pauses,
    publishers,
    skews,
)

ROOT = Path(__file__).resolve().parent.parent
COLUMNS = {  # the table's legend: a column per family of events
    "K": {"kill", "term", "fault"},
    "P": {"pause_worker"},
    "L": {"partition", "lag", "cut_link"},
    "S": {"skew"},
    "B": {"broker_restart", "pause_broker", "broker_rollback", "broker_wipe", "delete_stream"},
    "V": {"publish", "burst", "publish_hidden", "hide", "corrupt", "slow_reads"},
    "W": {"publisher_kill", "publisher_race"},
    "C": {"delete_consumer"},
    "T": {"trainer_kill", "second_client"},
    "R": {"forge", "snoop"},
    "G": {"gateway_kill", "gateway_pause", "gateway_restart"},
    "E": {"engine_kill", "engine_pause_error", "engine_freeze"},  # (drawn only with --sglang)
    "O": {"store_truncate", "store_drop", "store_lag"},  # (drawn only with --store s3)
    "D": {"disk_full", "disk_readonly"},
    "N": {"node_kill", "node_pause", "node_cut"},  # (drawn only with --cluster)
    "A": set(AUTOSCALER_EVENT_KINDS),  # (drawn only with --autoscale)
}


def test_every_invariant_has_a_row_and_every_event_a_column() -> None:
    doc = (ROOT / "docs" / "reliability.md").read_text()
    table = doc.split("### Which events attack which promise", 1)[1].split("\n### ", 1)[0]
    rows = [line for line in table.splitlines() if line.startswith("| `")]
    named = {name for line in rows for name in re.findall(r"`([a-z-]+)`", line.split("|")[1])}
    oracle = (ROOT / "reliability" / "adversary" / "oracle.py").read_text()
    judged = set(re.findall(r'self\.check\(\s*"([a-z-]+)"', oracle))
    for module in ("oracle_loop.py", "oracle_gateway.py"):  # (the loop's and the gateways' callers')
        text = (ROOT / "reliability" / "adversary" / module).read_text()
        judged |= set(re.findall(r'judge\.check\(\s*"([a-z-]+)"', text))
    text = (ROOT / "reliability" / "adversary" / "oracle_autoscale.py").read_text()  # (the autoscaler's)
    judged |= set(re.findall(r'\bcheck\(\s*"([a-z-]+)"', text))
    judged |= set(re.findall(r'Violation\(\s*"([a-z-]+)"', oracle))
    judged |= set(re.findall(r'self\.checks\["([a-z-]+)"\]', oracle))
    assert judged and judged <= named, f"invariants with no row: {sorted(judged - named)}"
    header = next(line for line in table.splitlines() if line.startswith("| invariant"))
    assert [c.strip() for c in header.split("|")[3:-1]] == list(COLUMNS)
    streams = [e for seed in range(20) for e in pauses(seed, 300) + skews(seed, 300) + links(seed, 300)
               + publishers(seed, 300) + gateways(seed, 300) + engines(seed, 300)
               + object_stores(seed, 300) + disks(seed, 300) + broker_stores(seed, 300)
               + nodes(seed, 300) + autoscalers(seed, 300)]  # fmt: skip
    drawn = set(WEIGHTS) | {e.kind for e in streams}
    covered = set().union(*COLUMNS.values())
    assert drawn <= covered, f"events with no column: {sorted(drawn - covered)}"
    for kind in covered:  # (every column names events the schedule can make)
        assert isinstance(params_for(kind, random.Random(0), False), dict)
    for kind in COLUMNS["E"]:
        assert engine_params(kind, random.Random(0))
    for kind in COLUMNS["O"]:
        assert object_store_params(kind, random.Random(0))
    for kind in COLUMNS["N"]:
        assert node_params(kind, random.Random(0))["which"] in ("leader", "random")


def test_the_page_has_its_generated_regions_and_a_campaign_is_written_into_its_own() -> None:
    from reliability.scenarios.common import Figures
    from reliability.scenarios.run import FIGURES, LATEST_CAMPAIGN, campaign_section, splice

    page = (ROOT / "docs" / "reliability.md").read_text()
    begin, end = "<!-- generated: latest campaign -->", "<!-- end: latest campaign -->"
    replay = "python -m reliability.adversary --seed 19 --duration 60"
    run = {"seed": "19", "seconds": 61.5, "events": 20, "checks": 900, "violations": 1, "replay": replay}
    fig = Figures("12", "The machine adversary", faults=20, submitted=80, completed=60)
    fig.notes["events by kind"] = {"kill": 3, "publish": 17}
    fig.notes["checks by invariant"] = {"loop-tokens": 2, "gone": 5}
    fig.notes["_campaign"] = {"runs": [run], "fresh": [19]}
    fig.problems.append(f"seed 19: [gone] job j1: ...  (replay: {replay})")
    written = splice(page, LATEST_CAMPAIGN, campaign_section(fig))
    region = written.split(begin, 1)[1].split(end, 1)[0]
    assert "It did not pass: 1 violations" in region and "[gone] job j1" in region and replay in region
    assert "publish 17, kill 3" in region and "fresh seeds (19)" in region
    # Everything outside the region is the page as it was, the figures' region included.
    assert written.split(begin, 1)[0] == page.split(begin, 1)[0]
    assert written.split(end, 1)[1] == page.split(end, 1)[1]
    assert "## Figures\n\nnew" in splice(written, FIGURES, "## Figures\n\nnew")
    fig.problems.clear()
    assert "It passed: 0 violations." in campaign_section(fig)
