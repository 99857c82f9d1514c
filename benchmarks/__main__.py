"""`make bench`: run every benchmarks/bench_*.py module and print its rows.

``python -m benchmarks [--quick] [NAME ...]`` runs the named ones (e.g. ``weights``).
"""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys
import time

from benchmarks import report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks")
    parser.add_argument("names", nargs="*", help="benchmark modules without the bench_ prefix")
    parser.add_argument("--quick", action="store_true", help="small sizes, for a smoke run")
    args = parser.parse_args(argv)
    import benchmarks

    found = sorted(
        m.name[len("bench_") :] for m in pkgutil.iter_modules(benchmarks.__path__) if m.name.startswith("bench_")
    )
    chosen = args.names or found
    unknown = set(chosen) - set(found)
    if unknown:
        parser.error(f"unknown benchmarks {sorted(unknown)}; have {found}")
    for name in chosen:
        module = importlib.import_module(f"benchmarks.bench_{name}")
        t0 = time.perf_counter()
        print(f"\n== {name} ==", flush=True)
        rows = module.run(quick=args.quick)
        print(report.header())
        for row in rows:
            print(row.line())
        js, md = report.write(name, rows)
        print(f"({time.perf_counter() - t0:.1f}s; wrote {js} and {md})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
