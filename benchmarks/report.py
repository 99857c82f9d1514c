"""One shape for every benchmark figure: a measured value next to a baseline from the same run."""

from __future__ import annotations

import json
import platform
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

RESULTS_DIR = Path(__file__).parent / "results"


@dataclass
class Row:
    bench: str  # e.g. "weights/apply"
    case: str  # e.g. "density=1%"
    metric: str  # e.g. "MB/s"
    value: float
    baseline: float | None = None  # same metric for the baseline, measured in the same run
    baseline_name: str = ""
    higher_is_better: bool = True
    target: str = ""  # e.g. ">= 1.5x baseline"
    extra: dict[str, object] = field(default_factory=dict)
    met: bool | None = None  # whether the target is met, judged by the bench on unrounded values

    @property
    def ratio(self) -> float | None:
        if self.baseline in (None, 0):
            return None
        return self.value / self.baseline  # type: ignore[operator]

    @property
    def verdict(self) -> str:
        if not self.target or self.met is None:
            return ""
        return f"{'met' if self.met else 'MISSED'} ({self.target})"

    def line(self) -> str:
        # Ratios with four decimals: a 0.7958x must never read as a met ">= 0.8x".
        ratio = f"{self.ratio:.4f}x {self.baseline_name}" if self.ratio is not None else ""
        base = f"{self.baseline:.6g}" if self.baseline is not None else "-"
        head = f"{self.bench:<28} {self.case:<26} {self.metric:<12}"
        return f"{head} {self.value:>12.6g} {base:>12} {ratio:<28} {self.verdict or self.target}"


def header() -> str:
    return f"{'bench':<28} {'case':<26} {'metric':<12} {'value':>12} {'baseline':>12} {'ratio':<28} target"


def write(name: str, rows: list[Row]) -> tuple[Path, Path]:
    """Write rows as JSON and as a markdown table under benchmarks/results/."""
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    meta = {
        "when": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "machine": platform.platform(),
        "python": platform.python_version(),
    }
    js = RESULTS_DIR / f"{name}.json"
    js.write_text(json.dumps({"meta": meta, "rows": [asdict(r) | {"ratio": r.ratio} for r in rows]}, indent=2))
    md = RESULTS_DIR / f"{name}.md"
    lines = [
        f"# {name}",
        "",
        f"{meta['when']} on {meta['machine']}",
        "",
        "Values with six significant digits and ratios with four decimals; met/missed is judged on",
        f"the unrounded values (in `{name}.json`).",
        "",
        "| bench | case | metric | value | baseline | ratio | target |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        ratio = f"{r.ratio:.4f}x {r.baseline_name}" if r.ratio is not None else ""
        base = f"{r.baseline:.6g}" if r.baseline is not None else ""
        target = r.verdict or r.target
        lines.append(f"| {r.bench} | {r.case} | {r.metric} | {r.value:.6g} | {base} | {ratio} | {target} |")
    md.write_text("\n".join(lines) + "\n")
    return js, md
