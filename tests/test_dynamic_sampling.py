"""Dynamic sampling (DAPO, arXiv 2503.14476): the group filter by hand, then 2 iterations through the CLI."""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path

import pytest
import torch

from epo_cli.algos.advantages import AdvantageEstimator
from epo_cli.algos.dynamic_sampling import choose_groups, concat_batches, rows_of_groups
from epo_cli.algos.group_filter import group_return_variance, group_signal, group_stats, passing_groups
from epo_cli.compose import compose
from epo_cli.config import AlgoConfig
from epo_cli.errors import ConfigError
from epo_cli.rollout.batch import TurnBatch

from conftest import SmallConfig, metrics_rows, only_run_dir, run_epo


def make_batch(trajs) -> TurnBatch:
    """trajs: list of (traj_id, group_id, outcome, [turn rewards]) or (..., [anchor observations])."""
    rows = [(tid, gid, t, len(rs), r, o, obs[t] if obs else f"o{tid}.{t}")
            for tid, gid, o, rs, *more in trajs for obs in [more[0] if more else None] for t, r in enumerate(rs)]
    col = list(zip(*rows))
    n = len(rows)
    return TurnBatch(
        prompt_ids=[[i] for i in range(n)], response_ids=[[2]] * n, traj_id=torch.tensor(col[0]),
        group_id=torch.tensor(col[1]), turn_index=torch.tensor(col[2]), num_turns=torch.tensor(col[3]),
        reward=torch.tensor(col[4], dtype=torch.float32), outcome=torch.tensor(col[5], dtype=torch.float32),
        valid=torch.ones(n, dtype=torch.bool), won=torch.tensor([o > 0 for o in col[5]]), task_type=["t"] * n,
        anchor_obs=list(col[6]),
    )


#: group 0: one win, one loss -> signal either way
#: group 1: two losses, returns 0 - 0.1 = -0.1 and 0 + 0 = 0
#: group 2: two losses of equal return: 1 turn [-0.1] vs 2 turns [0, -0.1] (both -0.1)
#: group 3: two wins of 3 turns, no penalties (returns 10, 10)
BATCH = [
    (0, 0, 10.0, [0.0]), (1, 0, 0.0, [0.0, 0.0]),
    (2, 1, 0.0, [-0.1, 0.0]), (3, 1, 0.0, [0.0, 0.0]),
    (4, 2, 0.0, [-0.1]), (5, 2, 0.0, [0.0, -0.1]),
    (6, 3, 10.0, [0.0, 0.0, 0.0]), (7, 3, 10.0, [0.0, 0.0, 0.0]),
]

#: The three cases of the dynamic-sampling premise, one group each (anchor observations for GiGPO):
#: group 0, "shorter path wins": both win (returns 10, 10), by 2 and 3 turns through one shared "start" state
#: group 1, "penalties on different turns": both lose, -0.1 at turn 0 vs at turn 1 (returns -0.1, -0.1)
#: group 2, "equal per-turn scores": both lose with a penalty on every turn, [-0.1] vs [-0.1, -0.1]
#:          (returns -0.1 and -0.2)
CASES = [
    (0, 0, 10.0, [0.0, 0.0], ["start", "a"]), (1, 0, 10.0, [0.0, 0.0, 0.0], ["start", "b", "c"]),
    (2, 1, 0.0, [-0.1, 0.0], ["d", "e"]), (3, 1, 0.0, [0.0, -0.1], ["f", "g"]),
    (4, 2, 0.0, [-0.1], ["h"]), (5, 2, 0.0, [-0.1, -0.1], ["i", "j"]),
]
#: the advantages each estimator gives those rows (defaults: eps 1e-6, GiGPO gamma 0.95, mean_std_norm), by hand:
#: grpo, mean_over=turns: the per-turn score is outcome + own reward.
#:   group 0: all 10 -> 0.  group 1: [-0.1, 0, 0, -0.1], mean -0.05, unbiased std = sqrt(4 * 0.05^2 / 3) =
#:   0.057735 -> -0.05/0.057735 = -0.866025 (penalised turns), +0.866025.  group 2: all -0.1 -> 0.
#: grpo, mean_over=trajectories / rloo: one score per trajectory = its return.
#:   groups 0 and 1: returns equal -> 0.  group 2: returns -0.1, -0.2: grpo (+-0.05) / (std 0.070711) =
#:   +-0.707107; rloo -0.1 - (-0.2) = +0.1 and -0.1.
#: gigpo (episode level as grpo turns, plus the step level):
#:   group 0: episode 0; discounted returns R = 0.95 * 10 = 9.5 (traj 0 at start), 0.95^2 * 10 = 9.025
#:   (traj 1 at start): the "start" step group normalises to +-0.2375 / 0.335876 = +-0.707107; every other
#:   state is alone -> 0.  group 1: episode +-0.866025, states all alone.  group 2: episode 0, states alone.
EXPECTED = {
    "grpo_turns": [0, 0, 0, 0, 0, -0.866025, 0.866025, 0.866025, -0.866025, 0, 0, 0],
    "grpo_trajectories": [0, 0, 0, 0, 0, 0, 0, 0, 0, 0.707107, -0.707107, -0.707107],
    "rloo": [0, 0, 0, 0, 0, 0, 0, 0, 0, 0.1, -0.1, -0.1],
    "gigpo": [0.707107, 0, -0.707107, 0, 0, -0.866025, 0.866025, 0.866025, -0.866025, 0, 0, 0],
}
#: so a group has signal (some |A| > 0) by case 0, 1, 2. The rule before, "trajectory returns differ",
#: said [False, False, True] for every estimator (and "outcomes differ" [False, False, False]): wrong
#: for grpo over turns (cases 1, 2) and gigpo (cases 0, 1, 2); for grpo over trajectories and rloo (whose
#: scores ARE the returns) only the outcome rule was wrong (case 2).
SIGNAL = {
    "grpo_turns": {0: False, 1: True, 2: False},
    "grpo_trajectories": {0: False, 1: False, 2: True},
    "rloo": {0: False, 1: False, 2: True},
    "gigpo": {0: True, 1: True, 2: False},
}


def estimator_algo(name: str, group_filter: str = "signal") -> AlgoConfig:
    algo = AlgoConfig(estimator=name.split("_")[0], group_filter=group_filter)
    if name == "grpo_trajectories":
        algo.grpo.mean_over = "trajectories"
    return algo


@pytest.mark.parametrize("name", sorted(SIGNAL))
def test_signal_is_what_the_estimator_gives_the_group(name):
    batch = make_batch(CASES)
    algo = estimator_algo(name)
    estimator = AdvantageEstimator.from_config(algo)
    adv, _ = estimator(batch)
    assert torch.allclose(adv.double(), torch.tensor(EXPECTED[name], dtype=torch.float64), atol=1e-5), adv
    assert group_signal(batch, estimator) == SIGNAL[name]
    # what dynamic sampling sees: (group, has signal, return variance) in group order
    returns_var = [0.0, 0.0, 0.0025]  # group 2: returns -0.1, -0.2 -> population variance 0.05^2
    stats = group_stats(batch, algo.group_filter, estimator)
    assert [(g, ok) for g, ok, _ in stats] == sorted(SIGNAL[name].items())
    assert [v for _, _, v in stats] == pytest.approx(returns_var, abs=1e-9)


def test_signal_filter_refuses_an_estimator_without_groups():
    with pytest.raises(ValueError, match="group estimator"):
        group_signal(make_batch(CASES), AdvantageEstimator.from_config(AlgoConfig(estimator="gae")))


def test_return_variance_and_the_filters_on_hand_made_groups():
    batch = make_batch(BATCH)
    # returns: group 0: 10, 0 -> var 25; group 1: -0.1, 0 -> 0.0025; group 2: -0.1, -0.1 -> 0; group 3: 0
    assert group_return_variance(batch) == pytest.approx({0: 25.0, 1: 0.0025, 2: 0.0, 3: 0.0}, abs=1e-9)
    # GRPO over turns: group 0 (10 vs 0) and group 1 (-0.1 vs 0) have signal; group 2's scores per turn are
    # [-0.1], [0, -0.1]: mean -0.0667, so they differ too (A != 0); group 3 is all 10
    grpo_turns = AdvantageEstimator.from_config(estimator_algo("grpo_turns"))
    assert group_signal(batch, grpo_turns) == {0: True, 1: True, 2: True, 3: False}
    stats = [(7, False, 0.0), (3, True, 4.0), (5, True, 0.5), (9, False, 0.5), (1, True, 1.0)]  # play order
    assert passing_groups(stats, "none") == [(7, True), (3, True), (5, True), (9, True), (1, True)]
    assert passing_groups(stats, "signal") == [(7, False), (3, True), (5, True), (9, False), (1, True)]
    # top_variance keeps ceil(keep x 5): 0.4 -> 2 groups (variances 4.0 and 1.0); 0.6 -> 3: the tie at 0.5
    # goes to the earlier group (5 before 9); 0.1 -> 1 group; 1.0 -> all
    assert passing_groups(stats, "top_variance", 0.4) == [(7, False), (3, True), (5, False), (9, False), (1, True)]
    assert passing_groups(stats, "top_variance", 0.6) == [(7, False), (3, True), (5, True), (9, False), (1, True)]
    assert [ok for _, ok in passing_groups(stats, "top_variance", 0.1)] == [False, True, False, False, False]
    assert all(ok for _, ok in passing_groups(stats, "top_variance", 1.0))
    # 0.5 x 4 = 2 groups exactly (no rounding up past 2)
    assert sum(ok for _, ok in passing_groups(stats[:4], "top_variance", 0.5)) == 2
    with pytest.raises(KeyError, match="unknown group filter 'acc'; valid: signal, top_variance, none"):
        passing_groups(stats, "acc")


def test_choose_groups_keeps_the_first_with_signal_in_play_order_then_tops_up():
    # round 0 (groups 0-3): 0 and 2 have signal; round 1 (groups 4-7): 5 and 6 have signal; target 3
    played = [(0, True), (1, False), (2, True), (3, False), (4, False), (5, True), (6, True), (7, False)]
    # the first three with signal: 0, 2, 5 (6 is surplus and discarded as DAPO truncates its batch)
    assert choose_groups(played, 3) == ([0, 2, 5], 0)
    # only round 0 played and the rounds ran out: 0, 2 with signal + the first zero-variance group (1)
    assert choose_groups(played[:4], 3) == ([0, 1, 2], 1)
    # nothing has signal: the batch is the first `target` groups as played
    assert choose_groups([(g, False) for g in range(4)], 2) == ([0, 1], 2)


def test_concat_and_select_whole_groups():
    a, b = make_batch(BATCH[:4]), make_batch(BATCH[4:])
    both = concat_batches([a, b])
    assert len(both) == len(a) + len(b) == 16
    assert both.traj_id.tolist() == a.traj_id.tolist() + b.traj_id.tolist()
    assert both.anchor_obs == a.anchor_obs + b.anchor_obs and both.prompt_ids == a.prompt_ids + b.prompt_ids
    rows = rows_of_groups(both, [3, 0])
    # group 3 = trajs 6, 7 (3 turns each) = the last 6 rows of b; group 0 = the first 3 rows of a
    assert rows == [10, 11, 12, 13, 14, 15, 0, 1, 2]
    picked = both.select(rows)
    assert picked.group_id.tolist() == [3] * 6 + [0] * 3
    # every field follows the rows: tensors and per-row lists (filled in or not), None stays None
    both.entropy = [torch.full((1,), float(r)) for r in range(len(both))]
    both.advantages = torch.arange(len(both), dtype=torch.float32)
    picked = both.select(rows)
    for f in fields(TurnBatch):
        value, full = getattr(picked, f.name), getattr(both, f.name)
        if isinstance(full, torch.Tensor):
            assert value.tolist() == full[rows].tolist(), f.name
        elif full is None:
            assert value is None, f.name
        else:
            assert value == [full[r] for r in rows] if full else value == [], f.name
    assert [float(e) for e in picked.entropy] == [float(r) for r in rows]


@pytest.mark.parametrize("overrides,needle", [
    (["algo=ppo", "algo.dynamic_sampling=true"], "group_size >= 2"),
    (["algo=ppo", "algo.group_size=4", "algo.dynamic_sampling=true"], "gae has no groups"),
    (["algo=grpo", "algo.group_filter=variance"], "none, signal, top_variance"),
    (["algo=grpo", "algo.group_filter_keep=0"], "0 < value <= 1"),
    (["algo=grpo", "algo.dynamic_sampling_max_rounds=-1"], "0 <= value"),
    (["algo=grpo", "algo.dynamic_sampling_metric=outcome"], "Unknown config key"),
])
def test_bad_dynamic_sampling_config(overrides, needle):
    with pytest.raises(ConfigError) as err:
        compose(overrides)
    assert needle in str(err.value)


def test_a_run_saved_with_the_retired_metric_key_still_loads(tmp_path: Path) -> None:
    from omegaconf import OmegaConf

    from epo_cli.compose import load_run_config

    saved = OmegaConf.to_container(compose(["algo=grpo", "algo.dynamic_sampling=true"]), resolve=True)
    saved["algo"]["dynamic_sampling_metric"] = "outcome"
    (tmp_path / "config.yaml").write_text(OmegaConf.to_yaml(OmegaConf.create(saved)))
    with pytest.warns(UserWarning, match="dynamic_sampling_metric, which is retired: dynamic sampling now keeps"):
        cfg = load_run_config(tmp_path)
    assert "dynamic_sampling_metric" not in cfg.algo and cfg.algo.group_filter == "signal"


def test_group_filter_settings_that_have_no_effect_warn():
    # PPO with groups: the return-variance filter is fine (no estimator involved)
    cfg = compose(["algo=ppo", "algo.group_size=4", "algo.dynamic_sampling=true", "algo.group_filter=top_variance"])
    assert cfg.algo.group_filter == "top_variance" and cfg.algo.group_filter_keep == 0.5
    with pytest.warns(UserWarning, match="group_filter=none: no group is ever dropped"):
        compose(["algo=grpo", "algo.dynamic_sampling=true", "algo.group_filter=none"])
    with pytest.warns(UserWarning, match="algo.group_filter=top_variance: no effect .*dynamic_sampling"):
        compose(["algo=grpo", "algo.group_filter=top_variance"])
    with pytest.warns(UserWarning, match=r"group_filter_keep=0.25: no effect in this run \(read only with "
                                         r"algo.group_filter=top_variance\)"):
        compose(["algo=grpo", "algo.dynamic_sampling=true", "algo.group_filter_keep=0.25"])
    # top_variance named, but by a key nothing reads: the reason is that key's
    with pytest.warns(UserWarning, match=r"algo.group_filter_keep=0.25, algo.group_filter=top_variance: no effect "
                                         r"in this run \(algo.dynamic_sampling=false\)"):
        compose(["algo=grpo", "algo.group_filter=top_variance", "algo.group_filter_keep=0.25"])


def dynamic_sampling_run(warm_start: Path, out: Path, steps: int, *extra: str) -> list[dict]:
    """`epo train` with dynamic sampling (2 groups x 4 rollouts per round, at most 2 extra rounds) from the warm
    start for `steps` iterations, in a fresh folder `out`; its metrics rows."""
    out.mkdir()
    run_epo(["train", "algo=grpo", f"model.path={warm_start / 'final'}", f"trainer.total_steps={steps}",
             *SmallConfig().run("algo.tasks_per_step=2", "algo.group_size=4", "algo.mini_batch_size=512",
                                "trainer.eval_every=0"), "algo.dynamic_sampling=true",
             "algo.dynamic_sampling_max_rounds=2", *extra,
             f"output_dir={out}", f"name={out.name}"], cwd=out)
    return metrics_rows(only_run_dir(out))


@pytest.mark.slow
def test_dynamic_sampling_two_iterations(warm_start: Path, tmp_path: Path) -> None:
    # subgoal rewards off and no invalid penalty: a group has signal only when some but not all of its
    # rollouts win, so zero-variance groups are common for this policy on 8 turns
    rows = dynamic_sampling_run(warm_start, tmp_path / "ds", 2)
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        rounds, dropped = r["rollout/sampling_rounds"], r["rollout/groups_dropped"]
        topped = r["rollout/groups_topped_up"]
        assert rounds in (0, 1, 2) and dropped >= 0 and topped in (0, 1, 2), r
        # the constant groups played were dropped or (rounds exhausted) topped up; at most all played
        assert dropped + topped <= (1 + rounds) * 2
        if rounds > 0:  # an extra round is played only after a zero-variance group
            assert dropped + topped >= 1, r
        if rounds < 2:  # stopped early: the batch filled with groups that have signal
            assert topped == 0, r
        # the success rate is over every played episode: (1 + rounds) rounds x 2 groups x 4 rollouts
        wins = r["rollout/success"] * (1 + rounds) * 8
        assert abs(wins - round(wins)) < 1e-6, r
    assert any(r["rollout/sampling_rounds"] > 0 for r in rows) or all(
        r["rollout/groups_dropped"] == 0 for r in rows)


@pytest.mark.slow
def test_top_variance_filter_refills_to_a_full_batch(warm_start: Path, tmp_path: Path) -> None:
    # 2 groups per round, keep 0.5: each round passes exactly one group (the higher return variance), so
    # the batch of 2 groups needs exactly one extra round, and the two groups that did not pass are dropped
    (row,) = dynamic_sampling_run(warm_start, tmp_path / "tv", 1, "algo.group_filter=top_variance")
    assert row["rollout/sampling_rounds"] == 1.0 and row["rollout/groups_dropped"] == 2.0, row
    assert row["rollout/groups_topped_up"] == 0.0
    assert abs(row["rollout/success"] * 16 - round(row["rollout/success"] * 16)) < 1e-6  # 2 rounds x 8 episodes
