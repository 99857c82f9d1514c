"""`make demo`: a small, real asynchronous RL run served by a local rollfleet.

A tiny Qwen3-style policy (built from a config, no downloads) learns a toy task with a
verifiable reward -- continue any prompt with the alternating pattern A B A B ... -- by
GRPO-style policy gradient. Rollouts come from two hf workers in their own processes,
through `RolloutLoop`: it keeps only as many groups in flight as the trainer can consume
within the staleness bound (so little is generated only to be dropped), judges each group's
staleness from the versions that made its tokens, and counts every token it received as trained
on or wasted, and why. Each
optimizer step publishes a new policy version as a verified weight delta, which the workers
prepare and activate while they keep serving. Off-policy samples are corrected with
importance weights from the served log-probs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shutil
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

PATTERN = (5, 9)  # the target: A B A B ...
VOCAB = 32


@dataclass
class StepStats:
    step: int
    version: int
    reward: float
    samples: int
    staleness_mean: float
    staleness_max: int
    dropped_stale: int  # samples (completions), the unit of `samples`
    dropped_groups: int  # the groups (of `group` samples) they came in
    replicas: dict[str, int]
    prepare_s: float | None
    pause_s: float | None
    seconds: float
    utilization: float | None = None  # busy fraction of the fleet's slots during the step
    trainer_wait_s: float = 0.0  # time the trainer waited for its batch
    waste_tokens: dict[str, int] = field(default_factory=dict)  # cause -> tokens not trained on


@dataclass
class DemoConfig:
    steps: int = 30
    prompts_per_step: int = 4
    group: int = 8
    max_tokens: int = 12
    max_staleness: int = 1
    lr: float = 1e-2
    clip: float = 0.2
    workers: int = 2
    seed: int = 0
    out: Path = Path("demo_out")
    nats: str | None = None  # use a running fleet instead of starting one
    namespace: str | None = None
    store: Path | None = None
    quiet: bool = False
    history: list[StepStats] = field(default_factory=list)
    totals: dict[str, int] = field(default_factory=dict)  # the loop's counters over the run


def reward(tokens: list[int]) -> float:
    """Fraction of generated positions that follow the pattern (verifiable, dense)."""
    if not tokens:
        return 0.0
    return sum(t == PATTERN[i % len(PATTERN)] for i, t in enumerate(tokens)) / len(tokens)


class Trainer:
    """The policy being trained (the trainer's copy) and one GRPO step over served samples."""

    def __init__(self, model_dir: Path, cfg: DemoConfig) -> None:
        import torch
        import transformers
        from transformers import AutoModelForCausalLM

        transformers.utils.logging.disable_progress_bar()
        torch.manual_seed(cfg.seed)
        self.torch = torch
        self.cfg = cfg
        self.model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
        self.model.train()
        self.opt = torch.optim.Adam(self.model.parameters(), lr=cfg.lr)

    def named_tensors(self) -> dict[str, Any]:
        # Under the checkpoint's names: these are what the publisher compares and ships.
        return {k: v.detach() for k, v in self.model.state_dict().items()}

    def step(self, samples: list[tuple[list[int], list[int], list[float], float]]) -> None:
        """samples: (prompt, output tokens, behaviour log-probs, group-normalised advantage)."""
        torch = self.torch
        seqs = torch.tensor([p + o for p, o, _, _ in samples])
        old_lp = torch.tensor([lp for _, _, lp, _ in samples])
        adv = torch.tensor([a for _, _, _, a in samples]).unsqueeze(1)
        plen = len(samples[0][0])
        logits = self.model(input_ids=seqs).logits[:, plen - 1 : -1].float()
        new_lp = torch.log_softmax(logits, -1).gather(-1, seqs[:, plen:].unsqueeze(-1)).squeeze(-1)
        # Importance weight of the current policy against the policy that served the sample.
        ratio = torch.exp(new_lp - old_lp)
        clipped = torch.clamp(ratio, 1 - self.cfg.clip, 1 + self.cfg.clip)
        loss = -torch.min(ratio * adv, clipped * adv).mean()
        self.opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.opt.step()


async def run(cfg: DemoConfig) -> list[StepStats]:
    from rollfleet.cli.local_fleet import LocalFleet
    from rollfleet.models import build_model_dir
    from rollfleet.schemas import SamplingParams, VersionActivated, decode
    from rollfleet.trainer_client import Group, LoopConfig, PolicyPublisher, RolloutClient, RolloutLoop

    out = cfg.out.resolve()
    if cfg.nats is None and out.exists():
        shutil.rmtree(out)  # a fresh model each run: start from a clean store and broker
    out.mkdir(parents=True, exist_ok=True)
    base = build_model_dir(out / "base", preset="tiny", seed=cfg.seed, vocab_size=VOCAB)
    store = cfg.store or out / "store"
    namespace = cfg.namespace or "demo"
    trainer = Trainer(base, cfg)
    publisher = PolicyPublisher(store, base, keyframe_every=10, keep_last=4)
    fleet = None
    rng = random.Random(cfg.seed)
    say = (lambda *a: None) if cfg.quiet else (lambda *a: print(*a, flush=True))
    try:
        if cfg.nats is None:
            fleet = LocalFleet(
                home=out / "fleet", namespace=namespace, workers=cfg.workers, engine="hf", store_dir=store
            )
            fleet.worker_args = ["--device", "cpu", "--capacity", "8", "--heartbeat", "1"]
            url = fleet.start_broker()
            say(f"broker {url}; starting {cfg.workers} hf workers ...")
        else:
            url = cfg.nats
        async with await RolloutClient.connect(url, namespace=namespace, client_id="demo-trainer") as client:
            # Version 0 (the base) in a fresh store; the next version in one kept from an
            # earlier run (e.g. the compose demo's volume).
            first = await client.publish_policy(publisher, trainer.named_tensors())
            if fleet is not None:
                fleet.start_workers()
                await fleet.wait_ready()
                say(fleet.describe())
            await client.wait_for_version(first.version, replicas=1, timeout=120)
            activations: dict[str, VersionActivated] = {}

            async def on_activated(msg: Any) -> None:
                a = decode(msg.data, VersionActivated)
                activations[a.worker_id] = a

            await client.nc.subscribe(client.names.versions_activated, cb=on_activated)

            async def prompts() -> Any:
                while True:
                    yield [rng.randrange(10, VOCAB) for _ in range(4)]

            async def score(group: Group) -> list[float]:
                return [reward(s.tokens) for s in group.samples]

            loop_cfg = LoopConfig(
                group_size=cfg.group,
                batch_groups=cfg.prompts_per_step,
                max_staleness=cfg.max_staleness,
                sampling=SamplingParams(max_tokens=cfg.max_tokens, temperature=1.0, logprobs=True),
                extra={"ignore_eos": True},
                job_timeout_s=300,
            )
            cols = ("step", "version", "reward", "stale", "util", "waste", "wait", "prepare", "pause")
            say(" ".join(f"{c:>{w}}" for c, w in zip(cols, _WIDTHS, strict=True)) + "  replicas")
            async with RolloutLoop(client, prompts(), loop_cfg, reward=score) as loop:
                t0 = time.perf_counter()
                async for batch in loop.batches(steps=cfg.steps):
                    for failure in batch.failed:
                        say(f"  group failed: {failure.reason} (after {failure.attempts} tries)")
                    if not batch.groups:  # (a last batch carries only failures)
                        continue
                    samples, rewards, staleness = [], [], []
                    for g in batch.groups:
                        group_rewards = g.rewards
                        mean = statistics.fmean(group_rewards)
                        std = statistics.pstdev(group_rewards) or 1.0
                        rewards += group_rewards
                        staleness.append(g.staleness)
                        for s in g.samples:
                            adv = (s.reward - mean) / (std + 1e-4)
                            samples.append((list(g.prompt), s.tokens, s.logprobs or [], adv))
                    trainer.step(samples)
                    record = await client.publish_policy(publisher, trainer.named_tensors())
                    replicas = {r.worker_id: r.active_version for r in client.fleet.replicas()}
                    prep = [a.prepare_s for a in activations.values()]
                    pause = [a.pause_s for a in activations.values()]
                    st = batch.stats
                    stats = StepStats(
                        step=batch.step,
                        version=record.version,
                        reward=statistics.fmean(rewards),
                        samples=len(samples),
                        staleness_mean=statistics.fmean(staleness),
                        staleness_max=max(staleness),
                        dropped_stale=st.waste_groups.get("stale", 0) * cfg.group,
                        dropped_groups=st.waste_groups.get("stale", 0),
                        replicas=replicas,
                        prepare_s=statistics.fmean(prep) if prep else None,
                        pause_s=statistics.fmean(pause) if pause else None,
                        seconds=time.perf_counter() - t0,
                        utilization=st.utilization,
                        trainer_wait_s=st.trainer_wait_s,
                        waste_tokens=st.waste_tokens,
                    )
                    t0 = time.perf_counter()
                    cfg.history.append(stats)
                    reps = " ".join(f"{w}@{v}" for w, v in sorted(replicas.items()))
                    util = "-" if st.utilization is None else f"{st.utilization:.0%}"
                    waste = sum(st.waste_tokens.values())
                    say(
                        f"{batch.step:>4} {record.version:>7} {stats.reward:>7.3f}"
                        f" {stats.staleness_mean:>5.2f}/{stats.staleness_max:<3} {util:>5} {waste:>6}"
                        f" {_fmt_s(st.trainer_wait_s):>8} {_fmt_s(stats.prepare_s):>8}"
                        f" {_fmt_s(stats.pause_s):>8}  {reps}"
                    )
                cfg.totals = dict(loop.totals)
    finally:
        if fleet is not None:
            fleet.stop()
    _report(cfg, out, say)
    return cfg.history


_WIDTHS = (4, 7, 7, 9, 5, 6, 8, 8, 8)


def _fmt_s(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value * 1000:.1f}ms" if value < 1 else f"{value:.2f}s"


def _report(cfg: DemoConfig, out: Path, say: Any) -> None:
    h = cfg.history
    if not h:
        return
    k = max(1, min(3, len(h) // 3))
    start, end = statistics.fmean(s.reward for s in h[:k]), statistics.fmean(s.reward for s in h[-k:])
    trained = sum(s.samples for s in h)
    dropped = sum(s.dropped_stale for s in h)
    waste: dict[str, int] = {}
    for s in h:
        for cause, tokens in s.waste_tokens.items():
            waste[cause] = waste.get(cause, 0) + tokens
    utils = [s.utilization for s in h if s.utilization is not None]
    summary = {
        "steps": len(h),
        "reward_start": start,
        "reward_end": end,
        "samples": trained,
        "samples_generated": trained + dropped,  # complete groups: trained on or dropped as stale
        "dropped_stale": dropped,  # samples
        "dropped_groups": sum(s.dropped_groups for s in h),
        "dropped_stale_fraction": dropped / (trained + dropped) if trained + dropped else 0.0,
        "waste_tokens": waste,  # by cause, during the steps (what the end of the run cancels is apart)
        "utilization_mean": statistics.fmean(utils) if utils else None,
        "trainer_wait_s": sum(s.trainer_wait_s for s in h),
        "loop_totals": cfg.totals,
        "max_staleness_seen": max(s.staleness_max for s in h),
        "max_staleness_allowed": cfg.max_staleness,
        "seconds": sum(s.seconds for s in h),
        "history": [asdict(s) for s in h],
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    say("")
    say("summary")
    say(f"  steps                    {len(h)}")
    say(f"  reward (first/last {k})    {start:.3f} -> {end:.3f}")
    fraction = f"{summary['dropped_stale_fraction']:.1%} of {trained + dropped} generated"
    dropped_txt = f"{dropped} samples in {summary['dropped_groups']} groups, {fraction}"
    say(f"  samples trained on       {trained}  (dropped as too stale: {dropped_txt})")
    say(f"  waste (tokens, by cause) {waste or 'none'}")
    if utils:
        say(f"  fleet utilization        {summary['utilization_mean']:.0%} of slots busy (mean over steps)")
    say(f"  trainer waited           {summary['trainer_wait_s']:.1f}s for batches")
    say(f"  staleness seen / allowed {summary['max_staleness_seen']} / {cfg.max_staleness}")
    say(f"  wall time in steps       {summary['seconds']:.1f}s")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, (ax, wax) = plt.subplots(2, 1, figsize=(7, 6), sharex=True, height_ratios=(3, 2))
        steps = [s.step for s in h]
        ax.plot(steps, [s.reward for s in h], color="tab:blue", label="reward")
        ax.set_ylabel("mean reward", color="tab:blue")
        ax2 = ax.twinx()
        ax2.plot(steps, [s.staleness_mean for s in h], color="tab:orange", label="staleness")
        ax2.set_ylabel("mean staleness of consumed samples", color="tab:orange")
        ax2.set_ylim(-0.05, cfg.max_staleness + 0.5)
        ax.set_title("rollfleet demo: async GRPO on a tiny Qwen3-style policy")
        bottom = [0] * len(h)
        causes = sorted({c for s in h for c in s.waste_tokens})
        for cause in causes:
            values = [s.waste_tokens.get(cause, 0) for s in h]
            wax.bar(steps, values, bottom=bottom, label=cause)
            bottom = [b + v for b, v in zip(bottom, values, strict=True)]
        wax.set_ylabel("tokens wasted")
        wax.set_xlabel("optimizer step (= policy version)")
        if causes:
            wax.legend(loc="upper right", fontsize="small")
        else:
            wax.text(0.5, 0.5, "nothing wasted", ha="center", va="center", transform=wax.transAxes)
        fig.tight_layout()
        fig.savefig(out / "rollfleet_demo.png", dpi=110)
        say(f"  plot                     {out / 'rollfleet_demo.png'}")
    except ImportError:
        say("  (install matplotlib for the plot)")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python examples/async_grpo.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--prompts-per-step", type=int, default=4)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--max-staleness", type=int, default=1)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="demo_out")
    p.add_argument("--nats", default=None, help="use this broker (a running fleet) instead of starting one")
    p.add_argument("--namespace", default=None)
    p.add_argument("--store", default=None, help="policy store the running fleet follows (with --nats)")
    p.add_argument("--quiet", action="store_true")
    a = p.parse_args(argv)
    cfg = DemoConfig(
        steps=a.steps,
        prompts_per_step=a.prompts_per_step,
        group=a.group,
        max_staleness=a.max_staleness,
        workers=a.workers,
        lr=a.lr,
        seed=a.seed,
        out=Path(a.out),
        nats=a.nats,
        namespace=a.namespace,
        store=Path(a.store) if a.store else None,
        quiet=a.quiet,
    )
    history = asyncio.run(run(cfg))
    return 0 if history else 1


if __name__ == "__main__":
    sys.exit(main())
