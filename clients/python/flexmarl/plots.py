"""``flexmarl plot``'s figure: reward and throughput curves per agent, held-out success per agent and team."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any


def plot_history(history: Sequence[Any], out: Path, title: str, evals: Sequence[Any] = ()) -> Path:
    """Reward and throughput curves per agent (and held-out success per agent and team: ``evals``), as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3 if evals else 2, figsize=(16 if evals else 11, 4))
    ax_reward, ax_tps = axes[0], axes[1]
    if evals:
        _plot_evals(axes[2], evals)
    agents = sorted({r.agent for r in history})
    for agent in agents:
        rows = sorted((r for r in history if r.agent == agent), key=lambda r: r.step)
        steps = [r.step for r in rows]
        reported = [(r.step, r.return_mean) for r in rows if r.return_mean is not None]
        line = ax_reward.plot([s for s, _ in reported], [v for _, v in reported], marker="o",
                              label=f"{agent} return")[0]
        if any(r.return_mean is None or r.return_mean != r.reward_mean for r in rows):  # shaped, or not recorded
            ax_reward.plot(steps, [r.reward_mean for r in rows], linestyle="--", marker=".",
                           color=line.get_color(), label=f"{agent} trained reward")
        ax_tps.plot(steps, [r.tokens_per_s for r in rows], marker=".", label=agent)
    ax_reward.set_xlabel("step")
    ax_reward.set_ylabel("mean episode return (dashed: trained reward)")
    plotted = [v for r in history for v in (r.return_mean, r.reward_mean) if v is not None]
    if all(0.0 <= v <= 1.0 for v in plotted):
        ax_reward.set_ylim(-0.05, 1.05)
    ax_reward.grid(alpha=0.3)
    ax_tps.set_xlabel("step")
    ax_tps.set_ylabel("rollout tokens/s")
    ax_tps.grid(alpha=0.3)
    for ax in (ax_reward, ax_tps):
        if agents:
            ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def _plot_evals(ax: Any, evals: Sequence[Any]) -> None:
    """The held-out success curve of each agent and of the team, by version."""
    from flexmarl.evaluation import eval_rows

    rows = eval_rows(evals)
    rows = [r for r in rows if not r["round"].startswith("d")]  # on-demand rounds are not the curve
    for scope in dict.fromkeys(r["scope"] for r in rows):
        mine = [r for r in rows if r["scope"] == scope]
        ax.plot([r["version"] for r in mine], [r["success"] for r in mine], marker="o",
                linestyle="--" if scope == "team" else "-", label=scope)
    ax.set_xlabel("version")
    ax.set_ylabel("held-out success")
    ax.set_ylim(-0.05, 1.05)
    ax.grid(alpha=0.3)
    ax.legend()
