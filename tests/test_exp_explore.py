"""scripts/experiments/exp_explore.py: its collapse and progress definitions against hand-computed series, its
arms composing as named, and its quick mode through the real `epo train` path (a summary with every arm's
figures, the claims table, a PNG; a second invocation reruns nothing)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from epo_cli.launch.setup import compose_for_train
from tests.test_benchmarks import script_temp_dir

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts" / "experiments"
sys.path.insert(0, str(SCRIPTS))

import exp_explore  # noqa: E402  (a script, importable once scripts/experiments/ is on the path)


def test_moving_average_and_runs() -> None:
    assert exp_explore.moving_average([0.3, 0.6, 0.0, 0.9]) == pytest.approx([0.3, 0.5])  # (.3+.6+0)/3, (.6+0+.9)/3
    assert exp_explore.moving_average([0.1, 0.2]) == []
    assert exp_explore.runs_of([True, True, False, True, False, False, True]) == [(0, 2), (3, 1), (6, 1)]
    assert exp_explore.runs_of([]) == []


def test_success_collapse_is_a_fall_of_0_2_within_5_iterations_of_the_moving_average() -> None:
    # moving averages: 0.6, 0.467, 0.333, 0.2, 0.333, 0.467, 0.6, 0.467, 0.333, 0.2
    # falling (>= 0.2 below one of the 5 before): entries 2, 3, 4 (0.6 - 0.333 at entry 4, j = 0) and 8, 9
    # -> two runs, two events
    assert exp_explore.success_collapses([0.6] * 3 + [0.2] * 3 + [0.6] * 3 + [0.2] * 3) == 2
    # moving averages 0.5, 0.4, 0.3, 0.2, 0.3, 0.4, 0.5: entries 2-4 fall by exactly 0.2 (bound counts) -> one event
    assert exp_explore.success_collapses([0.5] * 3 + [0.2] * 3 + [0.5] * 3) == 1
    # a slow decline: moving averages 0.6, 0.59, 0.57, 0.54, 0.51, 0.48, 0.45, 0.42; the largest fall within 5
    # entries is 0.57 - 0.42 = 0.15 < 0.2 -> none, although it falls 0.18 overall
    assert exp_explore.success_collapses([0.6, 0.6, 0.6, 0.57, 0.54, 0.51, 0.48, 0.45, 0.42, 0.39]) == 0
    # one bad iteration alone moves the average by 0.6 / 3 = 0.2: counted (the definition is that sensitive)
    assert exp_explore.success_collapses([0.6, 0.6, 0.6, 0.0, 0.6, 0.6]) == 1
    assert exp_explore.success_collapses([0.6, 0.6, 0.6, 0.3, 0.6, 0.6]) == 0  # 0.1 fall


def test_entropy_event_needs_5_consecutive_iterations_outside_the_band() -> None:
    ref = [None] + [1.0] * 7  # the logged Href, 1.0 from iteration 2 on; band (0.5, 1.5) -> [0.5, 1.5]
    flags = exp_explore.out_of_band_flags([1, 1, 2, 2, 2, 2, 2, 1], ref, 0.5, 1.5)
    assert flags == [False, True, True, True, True, True, False]
    assert exp_explore.entropy_events(flags) == 1
    four = exp_explore.out_of_band_flags([1, 1, 2, 2, 2, 2, 1, 0.4], ref, 0.5, 1.5)
    assert four == [False, True, True, True, True, False, True]  # runs of 4 and 1: no event
    assert exp_explore.entropy_events(four) == 0
    assert exp_explore.entropy_events([True] * 11) == 1
    assert exp_explore.entropy_events([True] * 5 + [False] + [True] * 5) == 2
    # a missing Href is EPO's cumulative mean of the earlier H: iteration 2's ref = 1 -> 3 > 1.5 x 1 is out;
    # iteration 3's logged ref 1.0 -> 0.2 < 0.5 x 1 is out; on the bound is inside
    assert exp_explore.out_of_band_flags([1.0, 3.0, 0.2], [None, None, 1.0], 0.5, 1.5) == [True, True]
    assert exp_explore.out_of_band_flags([1.0, 1.5], [None, 1.0], 0.5, 1.5) == [False]


def test_iterations_to_gain_and_diversity_halves() -> None:
    # moving averages of [0.2, 0.3, 0.4, 0.5, 0.6]: 0.3 (iterations 1-3), 0.4 (2-4), 0.5 (3-5) -> 0.45 at iteration 5
    assert exp_explore.iterations_to([0.2, 0.3, 0.4, 0.5, 0.6], 0.45) == 5
    assert exp_explore.iterations_to([0.2, 0.3, 0.4, 0.5, 0.6], 0.3) == 3
    assert exp_explore.iterations_to([0.2, 0.3, 0.4, 0.5, 0.6], 0.9) is None
    # 10 iterations: the first 20% is 2 -> mean(1, 2) = 1.5, the rest mean(3..10) = 6.5
    assert exp_explore.early_late([float(x) for x in range(1, 11)]) == pytest.approx((1.5, 6.5))
    assert exp_explore.early_late([0.4, 0.2])[0] == 0.4  # at least one iteration is early


def test_run_stats_on_a_hand_made_run() -> None:
    rows = [{"rollout/success": s, "policy/entropy": h, "rollout/diversity": d, "policy/entropy_swing": w,
             **({"policy/entropy_ref": 1.0} if i else {})}
            for i, (s, h, d, w) in enumerate(zip([0.6] * 3 + [0.2] * 3 + [0.6] * 4, [1.0] * 10,
                                                 [0.5, 0.5] + [0.25] * 8, [0.0, 0.2, 0.4] + [0.0] * 7))]
    stats = exp_explore.run_stats(rows, (0.0, 2.0))
    # final success = mean of the last 5 = (0.2 + 4 x 0.6) / 5; swing over iterations 2..10 = 0.6 / 9, max 0.4
    # diversity: early 0.5, late 0.25, drop 1 - 0.25 / 0.5; after iteration 12: none -> nan
    assert stats["final_success"] == pytest.approx(0.52) and stats["first_success"] == 0.6
    assert stats["swing_mean"] == pytest.approx(0.6 / 9) and stats["swing_max"] == 0.4
    diversity = (stats["diversity_early"], stats["diversity_late"], stats["diversity_drop"])
    assert diversity == pytest.approx((0.5, 0.25, 0.5))
    assert stats["diversity_drop_after_12"] != stats["diversity_drop_after_12"]
    assert stats["success_collapses"] == 1 and stats["entropy_events"] == 0 and stats["out_of_band_share"] == 0.0
    # mean |success change|: two changes of 0.4 in 9 steps
    assert stats["success_step_change"] == pytest.approx(0.8 / 9)


def test_arms_compose_to_what_they_name() -> None:
    def algo(key: str):
        return compose_for_train([f"experiment={exp_explore.EXPERIMENT}", *exp_explore.ARMS[key].overrides,
                                  "model.path=/a/warm/start/final"])[0]

    assert list(algo("grpo").algo.loss_terms) == ["policy_clip", "kl"]
    assert "entropy" in algo("grpo_bonus").algo.loss_terms and algo("grpo_bonus").entropy.coef == 0.1
    epo, bind = algo("epo"), algo("epo_bind")
    assert (epo.algo.name, epo.algo.estimator, epo.algo.entropy_smoothing.alpha) == ("epo", "grpo", 0.1)
    assert bind.algo.entropy_smoothing.alpha == 1.0 and "entropy" not in bind.algo.loss_terms
    assert algo("grpo_dyn").algo.dynamic_sampling is True
    assert algo("gigpo").algo.estimator == "gigpo"
    on_gigpo = algo("epo_gigpo").algo
    assert (on_gigpo.name, on_gigpo.estimator) == ("epo", "gigpo") and "entropy_smoothing" in on_gigpo.loss_terms
    assert algo("grpo_count").algo.intrinsic.kind == "count"


def test_missing_warm_start_is_named(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit):
        exp_explore.parse_args(["--warm-start", str(tmp_path)])
    assert "holds no final/ policy" in capsys.readouterr().err


@pytest.mark.slow
def test_quick_mode_writes_a_summary_and_reruns_nothing(tmp_path: Path, warm_start_short: Path) -> None:
    out = tmp_path / "study"
    _, env = script_temp_dir(tmp_path)
    command = [sys.executable, str(SCRIPTS / "exp_explore.py"), "--quick", "--warm-start", str(warm_start_short),
               "--out", str(out), "--jobs", "2"]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary["arms"]) == {"grpo", "epo"} and summary["iterations"] == 2
    assert 0.0 <= summary["warm_eval_success"] <= 1.0 and summary["eval_episodes"] == 4
    for arm in summary["arms"].values():
        assert arm["runs"] == 1 and arm["seeds"] == [0] and 0.0 <= arm["eval_success"] <= 1.0
        assert 0.0 <= arm["final_success"] <= 1.0 and arm["diversity_early"] > 0
        assert arm["success_collapses"] >= 0 and arm["entropy_events"] == 0  # 2 iterations cannot hold 5 out of band
    assert [len(r["success"]) for r in summary["runs"]] == [2, 2]
    assert any(c["claim"].startswith("early diversity, EPO") for c in summary["claims"])
    md = (out / "summary.md").read_text()
    assert "| GRPO | 1 |" in md and "| warm start |" in md and "Definitions" in md and "claimed" in md
    assert (out / "explore.png").stat().st_size > 5000
    again = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env)
    assert again.returncode == 0 and "$ epo train" not in again.stdout  # finished runs are reused
