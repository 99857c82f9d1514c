"""Engine adapters behind one interface; ``make_engine`` picks one by name."""

from __future__ import annotations

from typing import Any

from rollfleet.workers.engines.base import Engine, EngineHealth, Generation

ENGINES = ("echo", "hf", "sglang", "vllm")


def make_engine(name: str, **options: Any) -> Engine:
    """Build an engine by name; heavy adapters are imported only when asked for."""
    if name == "echo":
        from rollfleet.workers.engines.echo import EchoEngine

        return EchoEngine(**options)
    if name == "hf":
        from rollfleet.workers.engines.hf import HFEngine

        return HFEngine(**options)
    if name == "sglang":
        from rollfleet.workers.engines.sglang import SGLangEngine

        return SGLangEngine(**options)
    if name == "vllm":
        from rollfleet.workers.engines.vllm import VLLMEngine

        return VLLMEngine(**options)
    raise ValueError(f"unknown engine {name!r}; choose one of {', '.join(ENGINES)}")


__all__ = ["ENGINES", "Engine", "EngineHealth", "Generation", "make_engine"]
