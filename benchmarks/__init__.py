"""Measured comparisons. Each ``bench_*.py`` module has ``run(quick: bool) -> list[Row]``."""
