"""Models built from a config on the spot (no downloads), for tests, the demo and benchmarks."""

from rollfleet.models.tiny import PRESETS, build_model_dir, load_model_tensors, model_config, param_count

__all__ = ["PRESETS", "build_model_dir", "load_model_tensors", "model_config", "param_count"]
