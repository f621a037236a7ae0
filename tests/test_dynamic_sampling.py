"""Dynamic sampling (DAPO, arXiv 2503.14476): the group filter by hand, then 2 iterations through the CLI."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from epo_cli.algos.dynamic_sampling import choose_groups, concat_batches, group_has_signal, rows_of_groups
from epo_cli.compose import compose
from epo_cli.errors import ConfigError
from epo_cli.rollout.batch import TurnBatch

from conftest import SmallConfig, only_run_dir, run_epo


def make_batch(trajs) -> TurnBatch:
    """trajs: list of (traj_id, group_id, outcome, [turn rewards])."""
    rows = [(tid, gid, t, len(rs), r, o) for tid, gid, o, rs in trajs for t, r in enumerate(rs)]
    col = list(zip(*rows))
    n = len(rows)
    return TurnBatch(
        prompt_ids=[[i] for i in range(n)], response_ids=[[2]] * n, traj_id=torch.tensor(col[0]),
        group_id=torch.tensor(col[1]), turn_index=torch.tensor(col[2]), num_turns=torch.tensor(col[3]),
        reward=torch.tensor(col[4], dtype=torch.float32), outcome=torch.tensor(col[5], dtype=torch.float32),
        valid=torch.ones(n, dtype=torch.bool), won=torch.tensor([o > 0 for o in col[5]]), task_type=["t"] * n,
        anchor_obs=[f"o{i}" for i in range(n)],
    )


#: group 0: one win, one loss -> signal either way
#: group 1: two losses, returns 0 - 0.1 = -0.1 and 0 + 0 = 0 -> signal by return, none by outcome
#: group 2: two losses of equal return: 1 turn [-0.1] vs 2 turns [0, -0.1] (both -0.1) -> no signal
#: group 3: two wins of 3 turns, no penalties (returns 10, 10) -> no signal
BATCH = [
    (0, 0, 10.0, [0.0]), (1, 0, 0.0, [0.0, 0.0]),
    (2, 1, 0.0, [-0.1, 0.0]), (3, 1, 0.0, [0.0, 0.0]),
    (4, 2, 0.0, [-0.1]), (5, 2, 0.0, [0.0, -0.1]),
    (6, 3, 10.0, [0.0, 0.0, 0.0]), (7, 3, 10.0, [0.0, 0.0, 0.0]),
]


def test_zero_variance_groups_by_return_and_by_outcome():
    batch = make_batch(BATCH)
    assert group_has_signal(batch, "return") == {0: True, 1: True, 2: False, 3: False}
    assert group_has_signal(batch, "outcome") == {0: True, 1: False, 2: False, 3: False}
    with pytest.raises(ValueError, match="return | outcome"):
        group_has_signal(batch, "acc")


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


@pytest.mark.parametrize("overrides,needle", [
    (["algo=ppo", "algo.dynamic_sampling=true"], "group_size >= 2"),
    (["algo=grpo", "algo.dynamic_sampling_metric=acc"], "return, outcome"),
    (["algo=grpo", "algo.dynamic_sampling_max_rounds=-1"], "0 <= value"),
])
def test_bad_dynamic_sampling_config(overrides, needle):
    with pytest.raises(ConfigError) as err:
        compose(overrides)
    assert needle in str(err.value)


@pytest.mark.slow
def test_dynamic_sampling_two_iterations(warm_start: Path, tmp_path: Path) -> None:
    # subgoal rewards off and no invalid penalty: a group has signal only when some but not all of its
    # rollouts win, so zero-variance groups are common for this policy on 8 turns
    out = tmp_path / "ds"
    out.mkdir()
    run_epo(["train", "algo=grpo", f"model.path={warm_start / 'final'}", "trainer.total_steps=2",
             *SmallConfig().run("algo.tasks_per_step=2", "algo.group_size=4", "algo.mini_batch_size=512",
                                "trainer.eval_every=0"), "algo.dynamic_sampling=true",
             "algo.dynamic_sampling_max_rounds=2", "algo.dynamic_sampling_metric=outcome",
             f"output_dir={out}", "name=ds"], cwd=out)
    run = only_run_dir(out)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
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
