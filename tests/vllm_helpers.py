"""What the vllm engine's tests share: the cached vLLM environment, a model vLLM's CPU kernels take,
a server started from that environment, and the trainer-side view of weights.

The environment is ``.venv-vllm`` (``make vllm-env``; ``ROLLFLEET_VLLM_VENV`` names another). Where
it could not be installed, ``.unavailable`` in it says why and the tests skip with that reason;
where it was never built, they skip and say how to build it.
"""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import time
from pathlib import Path

import httpx
import torch
from safetensors.torch import load_file, save_file

from rollfleet.broker import free_port
from rollfleet.models import build_model_dir
from rollfleet.workers.engines.vllm import EMPTY_SHA256, SERVER_ENV, server_command

REPO = Path(__file__).resolve().parent.parent
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
# Modest threads on shared cores; 1 GiB of KV cache is plenty for these tests.
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


def build_model(path: Path, seed: int = 1) -> Path:
    return build_model_dir(path, seed=seed, **MODEL)


class Server:
    """A vLLM server from the cached environment, in its own process group (stopped with it)."""

    def __init__(self, model: Path, log: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        cmd = server_command(str(PYTHON), str(model), "127.0.0.1", self.port, LAUNCH_ARGS)
        env = {**os.environ, **SERVER_ENV, **SERVER_ENV_CPU}
        with open(log, "ab") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        self.started_s = self._wait_healthy(time.monotonic(), timeout=600)

    def _wait_healthy(self, t0: float, timeout: float) -> float:
        while time.monotonic() - t0 < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vLLM exited with {self.proc.returncode} while starting:\n{self.tail()}")
            try:
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    return time.monotonic() - t0
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
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


def load_tensors(model_dir: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    return tensors


def write_version(base: Path, out: Path, tensors: dict[str, torch.Tensor]) -> Path:
    """A whole checkpoint of ``tensors`` with ``base``'s config (what a trainer's version holds)."""
    out.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", "generation_config.json"):
        (out / name).write_bytes((base / name).read_bytes())
    save_file(
        {k: v.contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"), metadata={"format": "pt"}
    )
    return out


def perturb(tensors: dict[str, torch.Tensor], seed: int, scale: float = 0.5) -> dict[str, torch.Tensor]:
    """A clearly different version: every weight matrix moved by noise of ``scale``."""
    gen = torch.Generator().manual_seed(seed)
    return {
        k: (v + torch.randn(v.shape, generator=gen) * scale if v.dim() == 2 else v.clone()) for k, v in tensors.items()
    }


def sha256(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().view(-1).view(torch.uint8).numpy()).hexdigest()


def expected_vllm_checksums(tensors: dict[str, torch.Tensor]) -> dict[str, str]:
    """What vLLM's /weight_checker should say for the trainer's ``tensors``: its fused parameters
    (``qkv_proj`` = q, k, v stacked; ``gate_up_proj`` = gate, up) hashed as vLLM hashes them."""
    out = {name: sha256(t) for name, t in tensors.items()}
    for prefix in {n.rsplit(".self_attn.", 1)[0] for n in tensors if ".self_attn.q_proj." in n}:
        a, m = f"{prefix}.self_attn.", f"{prefix}.mlp."
        qkv = [tensors[a + p + "_proj.weight"] for p in "qkv"]
        out[a + "qkv_proj.weight"] = sha256(torch.cat(qkv))
        out[m + "gate_up_proj.weight"] = sha256(
            torch.cat([tensors[m + "gate_proj.weight"], tensors[m + "up_proj.weight"]])
        )
    return out


def comparable(live: dict[str, str]) -> dict[str, str]:
    """The parameters vLLM's checker can vouch for: on CPU, linear layers repacked for the GEMM
    kernels hash as empty."""
    return {name: digest for name, digest in live.items() if digest != EMPTY_SHA256}
