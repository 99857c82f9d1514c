"""A real vLLM server for the tests and the benchmarks: the cached vLLM environment, a model
vLLM's CPU kernels take, and a server started from that environment in its own process group.

The environment is ``.venv-vllm`` at the repository root (``make vllm-env``;
``ROLLFLEET_VLLM_VENV`` names another). Where it could not be installed, ``.unavailable`` in it
says why (:func:`unavailable`), and callers skip with that reason.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx

from rollfleet.broker import free_port
from rollfleet.workers.engines.vllm import SERVER_ENV, built_for_cpu, server_command

REPO = Path(__file__).resolve().parents[1]
VENV = Path(os.environ.get("ROLLFLEET_VLLM_VENV") or REPO / ".venv-vllm")
if not VENV.is_absolute():
    VENV = REPO / VENV
PYTHON = VENV / "bin" / "python"

# vLLM's CPU attention takes head_dim 64 (the tiny preset's 16 is refused), and blocks of a
# multiple of 32 tokens (32 here so that short session turns show prefix reuse).
MODEL = {"preset": "tiny", "head_dim": 64, "hidden_size": 256}
LAUNCH_ARGS = [
    "--dtype", "float32", "--max-model-len", "2048", "--enforce-eager", "--block-size", "32",
    "--max-num-seqs", "16", "--max-num-batched-tokens", "2048",
]  # fmt: skip
# Modest threads on shared cores; 1 GiB of KV cache is plenty for a tiny model.
SERVER_ENV_CPU = {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "OMP_NUM_THREADS": "1",
    "VLLM_LOGGING_LEVEL": "WARNING",
}
BLOCK = 32


def unavailable() -> str | None:
    """Why the vLLM environment cannot be used here (None when it can)."""
    if (VENV / ".installed").exists() and PYTHON.exists():
        return None
    reason = VENV / ".unavailable"
    if reason.exists():
        return reason.read_text().strip()
    return f"no vLLM environment at {VENV}: build it with `make vllm-env` (or run `make test`)"


def build_model(path: Path, seed: int = 1, **overrides: object) -> Path:
    """A Qwen3-shaped model directory vLLM serves on CPU (``MODEL``, or ``overrides`` of it)."""
    from rollfleet.models import build_model_dir  # (torch: the hf extra)

    return build_model_dir(path, seed=seed, **{**MODEL, **overrides})  # type: ignore[arg-type]


def write_version(base: Path, out: Path, tensors: dict[str, Any]) -> Path:
    """A whole checkpoint of ``tensors`` with ``base``'s config: what a trainer's version holds,
    and what a replica's host-local copy of it holds."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", "generation_config.json"):
        if (base / name).exists():
            (out / name).write_bytes((base / name).read_bytes())
    owned = {k: v.contiguous() for k, v in tensors.items()}
    save_file(owned, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


class Server:
    """A vLLM server from the cached environment, in its own process group (stopped with it)."""

    def __init__(self, model: Path, log: Path, launch_args: Sequence[str] = LAUNCH_ARGS, timeout: float = 600) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        cpu = built_for_cpu(str(PYTHON))
        cmd = server_command(str(PYTHON), str(model), "127.0.0.1", self.port, list(launch_args), cpu=cpu)
        env = {**os.environ, **SERVER_ENV, **SERVER_ENV_CPU}
        with open(log, "ab") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        self.started_s = self._wait_healthy(time.monotonic(), timeout=timeout)

    def _wait_healthy(self, t0: float, timeout: float) -> float:
        while time.monotonic() - t0 < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vLLM exited with {self.proc.returncode} while starting:\n{self.tail()}")
            try:
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    return time.monotonic() - t0
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"vLLM not healthy after {timeout} s:\n{self.tail()}")

    def tail(self, chars: int = 4000) -> str:
        return self.log.read_text(errors="replace")[-chars:] if self.log.exists() else ""

    def metric(self, name: str) -> float:
        """A counter of vLLM's Prometheus endpoint (summed over its label sets)."""
        text = httpx.get(self.url + "/metrics", timeout=10).text
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # children that outlived the server
        except ProcessLookupError:
            pass
