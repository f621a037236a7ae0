"""The metrics of one training step, assembled in one place (names: design notes, Conventions).

Every value is over all ranks: per-rank (sum, count) pairs are all-reduced (`reduce_sums`), batch totals
are all-reduced sums. Timings (perf/*_s) are this rank's own.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from epo_cli.algos.entropy import response_diversity, step_statistics
from epo_cli.rollout.batch import TurnBatch
from epo_cli.rollout.episodes import Episode, RolloutStats, episode_metrics
from epo_cli.training.engine import all_gather_objects, all_reduce_sum

_LEVEL_WINS, _LEVEL_EPISODES = "curriculum/level_wins/", "curriculum/level_episodes/"


def reduce_sums(sums: dict[str, tuple[float, float]], device: torch.device) -> dict[str, float]:
    """All-reduce {name: (sum, count)} over ranks; value = sum/count (or the sum where count is 0)."""
    names = sorted(set().union(*all_gather_objects(sorted(sums))))  # ranks may see different task types
    vec = torch.tensor([[sums.get(n, (0.0, 0.0))[0], sums.get(n, (0.0, 0.0))[1]] for n in names],
                       dtype=torch.float64, device=device).reshape(-1, 2)
    vec = all_reduce_sum(vec)
    out = {}
    for n, (s, c) in zip(names, vec.tolist()):
        out[n] = s / c if c > 0 else s
    return out


def rollout_sums(episodes: list[Episode], stats: RolloutStats) -> dict[str, tuple[float, float]]:
    """This rank's (sum, count) of every rollout quantity, for `reduce_sums`."""
    sums = episode_metrics(episodes)  # rollout/success, episode_len, invalid_rate, ... (epo_cli.rollout.episodes)
    for ep in episodes:  # wins and episodes per curriculum level: counters, summed over ranks
        for key, value in ((f"{_LEVEL_WINS}{ep.task.level}", float(ep.won)),
                           (f"{_LEVEL_EPISODES}{ep.task.level}", 1.0)):
            sums[key] = (sums.get(key, (0.0, 0.0))[0] + value, 0.0)
    groups = float(len({ep.group_id for ep in episodes}))
    for key, value in response_diversity([(ep.group_id, ep.actions) for ep in episodes]).items():
        sums[key] = (value * groups, groups)  # the mean over every rank's groups
    sums["perf/generated_tokens"] = (float(stats.generated_tokens), 0.0)
    sums["perf/env_steps"] = (float(stats.env_steps), 0.0)
    return sums


def level_results(reduced: dict[str, float]) -> dict[str, tuple[float, float]]:
    """{level: (wins, episodes)} over all ranks, from the reduced rollout sums: the curriculum's feedback
    (true task success per level, whatever the shaped rewards)."""
    return {k.rsplit("/", 1)[1]: (v, reduced[k.replace("level_wins", "level_episodes")])
            for k, v in reduced.items() if k.startswith(_LEVEL_WINS)}


def rollout_metrics(reduced: dict[str, float]) -> dict[str, float]:
    """rollout/* (success, success/<task_type>, episode_len, invalid_rate, truncated, diversity, ...) and
    curriculum/level_success/<level>, from the reduced rollout sums."""
    out = {k: v for k, v in reduced.items() if not k.startswith(("curriculum/level_", "perf/"))}
    out.update({f"curriculum/level_success/{level}": wins / max(n, 1.0)
                for level, (wins, n) in level_results(reduced).items()})
    return out


def entropy_statistics(entropy: list[torch.Tensor], turn_index: torch.Tensor,
                       width: int) -> tuple[torch.Tensor, torch.Tensor, float, dict[str, float]]:
    """Per-turn sums and counts ([width] float64) of the rollout's token entropies over all ranks, their
    mean, and policy/entropy, policy/entropy_turn/<t>. Collectives: every rank calls this."""
    sums, counts = step_statistics(entropy, turn_index, width)
    sums, counts = all_reduce_sum(sums.double()), all_reduce_sum(counts.double())
    mean = float(sums.sum() / counts.sum().clamp(min=1))
    metrics = {"policy/entropy": mean}
    for t in torch.nonzero(counts).flatten().tolist():
        metrics[f"policy/entropy_turn/{t}"] = float(sums[t] / counts[t])
    return sums, counts, mean, metrics


def batch_metrics(batch: TurnBatch, reused_rows: int, subgoal_coef: float, max_turns: int) -> dict[str, float]:
    """What the update trained on, summed over ranks. Collectives: every rank calls this."""
    samples = float(all_reduce_sum(torch.tensor(float(len(batch)))))
    # the intrinsic bonus (algo.intrinsic) is part of `reward` for the estimators; reported on its own
    has_bonus = batch.intrinsic is not None  # set by the config: the same on every rank
    intrinsic = batch.intrinsic.sum().double() if has_bonus else torch.zeros((), dtype=torch.float64)
    out = {"rollout/intrinsic_reward": float(all_reduce_sum(intrinsic))} if has_bonus else {}
    return {
        **out,
        "rollout/subgoal_coef": subgoal_coef,  # curriculum's reward per subgoal reached this step
        "rollout/max_turns": float(max_turns),  # curriculum's turn limit this step
        # the task reward (outcome, once per trajectory) and the turn-local shaped reward (without the
        # intrinsic bonus), summed
        "rollout/task_reward": float(all_reduce_sum(batch.outcome[batch.is_last_turn].sum().double())),
        "rollout/shaped_reward": float(all_reduce_sum(batch.reward.sum().double() - intrinsic)),
        # share of samples whose old log-probs came from the update's first forward (no scoring pass)
        "perf/scoring_reused": float(all_reduce_sum(torch.tensor(float(reused_rows)))) / max(samples, 1.0),
        "rollout/samples": samples,  # turn samples in the update
    }


def perf_metrics(stats: RolloutStats, reduced: dict[str, float], score_s: float, update_s: float,
                 lr: float) -> dict[str, float]:
    """Timings (this rank), throughputs (all ranks' tokens and env steps over this rank's time) and lr."""
    return {
        "perf/rollout_s": stats.rollout_s,  # wall time of the rollout
        "perf/generate_s": stats.generate_s,  # time in the policy's generate calls
        "perf/env_s": stats.env_s,  # time some env was resetting or stepping
        "perf/env_wait_s": stats.env_wait_s,  # time the rollout waited for envs
        # > 1 when generation and env steps overlapped (rollout.overlap)
        "perf/overlap_ratio": stats.rollout_s / max(stats.generate_s + stats.env_s, 1e-9),
        "perf/score_s": score_s,  # the scoring forward (old/reference log-probs, values)
        "perf/update_s": update_s,  # ppo_epochs x mini-batches of forward/backward/step
        "perf/gen_tokens_per_s": reduced["perf/generated_tokens"] / max(stats.generate_s, 1e-9),
        "perf/env_steps_per_s": reduced["perf/env_steps"] / max(stats.env_s, 1e-9),
        "perf/lr": lr,
    }


@dataclass
class UpdateTally:
    """Running totals of one update (every mini-batch of every epoch)."""

    totals: dict[str, float] = field(default_factory=dict)  # each term metric, summed over ranks and steps
    optimizer_steps: int = 0
    skipped: int = 0  # optimizer steps skipped for a non-finite loss or gradient
    real_tokens: int = 0
    padded_tokens: int = 0
    grad_norms: list[float] = field(default_factory=list)

    def add_step(self, reduced: dict[str, float]) -> None:
        """One optimizer step's term metrics (already summed over micro-batches and ranks)."""
        for k, v in reduced.items():
            self.totals[k] = self.totals.get(k, 0.0) + v
        self.optimizer_steps += 1

    def metrics(self) -> dict[str, float]:
        """loss/<term>, policy/clipfrac, ... (mean over optimizer steps) and the update's perf counters."""
        out = {k: v / max(self.optimizer_steps, 1) for k, v in self.totals.items()}
        out.update({
            "perf/optimizer_steps": float(self.optimizer_steps),
            "perf/skipped_updates": float(self.skipped),
            "perf/padding_efficiency": self.real_tokens / max(self.padded_tokens, 1),  # real / padded tokens
        })
        if self.grad_norms:
            out["perf/grad_norm"] = sum(self.grad_norms) / len(self.grad_norms)
        return out


def critic_metrics(values: torch.Tensor, returns: torch.Tensor, device: torch.device) -> dict[str, float]:
    """critic/explained_variance (1 - Var(returns - values) / Var(returns)) and critic/value_mean, over all
    ranks' samples."""
    v, r = values.double(), returns.double()
    stats = all_reduce_sum(torch.stack([torch.tensor(float(len(v)), dtype=torch.float64), r.sum(), (r * r).sum(),
                                        (r - v).sum(), ((r - v) ** 2).sum(), v.sum()]).to(device)).tolist()
    n, rs, rss, es, ess, vs = stats
    var_r = rss / n - (rs / n) ** 2
    var_e = ess / n - (es / n) ** 2
    return {"critic/explained_variance": 1.0 - var_e / var_r if var_r > 1e-12 else float("nan"),
            "critic/value_mean": vs / n}
