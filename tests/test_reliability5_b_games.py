"""Issue 41, class 4: a damaged TextWorld game cannot kill a run.

The Z-machine interpreter ends the whole process on a damaged story file ("Fatal error: Story file read
error", exit 0 or 1, status.json left `running`); a garbage or missing game .json was a traceback; a worker
that died resetting a game twice was a RuntimeError traceback. Now every game is checked before it is played:
a damaged cached game is generated again (one warning naming it), a damaged game of env.games_dir is refused
naming it, a game damaged during a run is refused at its reset, and a worker's death where the pool cannot go
on is one message (the run: status `failed`). Every row failed on the code before this change.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from epo_cli.envs.base import Env, EnvSuite, StepResult, Task
from epo_cli.envs.pool import EnvPool, EnvWorkerDied
from epo_cli.envs.textworld_games import TextWorldConfig, TextWorldSuite, game_damage
from epo_cli.errors import UserError

from conftest import one_error, run_epo

pytest.importorskip("textworld", reason="textworld is not installed (pip install 'epo[envs]')")
pytestmark = [pytest.mark.realenv]

#: the smallest tw-make game (~2 s to generate); one train game, no evaluation split
GAME_OPTIONS = {"num_games": 1, "num_eval_games": 1, "world_size": 2, "nb_objects": 3, "quest_length": 2,
                "seed": 7, "eval_splits": []}
GAME = "game_7.z8"


def _truncate(game: Path) -> None:
    game.write_bytes(game.read_bytes()[:1000])


def _empty(game: Path) -> None:
    game.write_bytes(b"")


def _random_bytes(game: Path) -> None:
    game.write_bytes(random.Random(0).randbytes(game.stat().st_size))


def _flip_one_byte(game: Path) -> None:  # the header still agrees: only the recorded SHA-256 sees it
    data = bytearray(game.read_bytes())
    data[len(data) // 2] ^= 0xFF
    game.write_bytes(bytes(data))


def _garbage_json(game: Path) -> None:
    game.with_suffix(".json").write_text("garbage")


def _missing_json(game: Path) -> None:
    game.with_suffix(".json").unlink()


def _json_of_something_else(game: Path) -> None:
    game.with_suffix(".json").write_text('{"version": 1}')


def _fifo(game: Path) -> None:  # read as a game it would hang
    game.unlink()
    os.mkfifo(game)


DAMAGE: dict[str, tuple[Callable[[Path], None], str]] = {
    "truncated": (_truncate, "where its header declares"),
    "emptied": (_empty, "shorter than a Z-machine header"),
    "random bytes": (_random_bytes, "not 1-8"),
    "garbage json": (_garbage_json, "game_7.json is not JSON"),
    "missing json": (_missing_json, "game_7.json is missing"),
    "json of something else": (_json_of_something_else, "is not a TextWorld game"),
    "fifo": (_fifo, "not a regular file"),
}


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A generated cache holding one game (and its SHA-256 record), copied by each test."""
    cache = tmp_path_factory.mktemp("textworld-cache")
    TextWorldSuite(TextWorldConfig(cache_dir=str(cache), **GAME_OPTIONS)).check()
    return cache


def _cache(pristine: Path, tmp_path: Path) -> tuple[TextWorldSuite, Path]:
    cache = tmp_path / "cache"
    shutil.copytree(pristine, cache)
    suite = TextWorldSuite(TextWorldConfig(cache_dir=str(cache), **GAME_OPTIONS))
    return suite, suite.split_folder("train") / GAME


def _digests(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir()) if p.is_file()}


def test_generated_games_carry_their_sha256(pristine: Path, tmp_path: Path) -> None:
    _, game = _cache(pristine, tmp_path)
    record = game.with_suffix(".sha256").read_text().splitlines()
    assert record == [f"{hashlib.sha256(game.read_bytes()).hexdigest()}  game_7.z8",
                      f"{hashlib.sha256(game.with_suffix('.json').read_bytes()).hexdigest()}  game_7.json"]
    assert game_damage(game, record=True) is None


@pytest.mark.parametrize("damage", [*DAMAGE, "one byte flipped"])
def test_a_damaged_cached_game_is_generated_again(damage: str, pristine: Path, tmp_path: Path) -> None:
    suite, game = _cache(pristine, tmp_path)
    before = json.loads(game.with_suffix(".json").read_text())
    (_flip_one_byte if damage == "one byte flipped" else DAMAGE[damage][0])(game)
    with pytest.warns(UserWarning, match=f"TextWorld game {game} in the cache is damaged"):
        suite.check()
    assert game_damage(game, record=True) is None
    assert json.loads(game.with_suffix(".json").read_text())["quests"] == before["quests"]  # the same game


def test_a_cache_without_records_is_checked_and_recorded(pristine: Path, tmp_path: Path) -> None:
    suite, game = _cache(pristine, tmp_path)  # as a cache made before the records
    game.with_suffix(".sha256").unlink()
    suite.check()
    assert game.with_suffix(".sha256").is_file() and game_damage(game, record=True) is None


@pytest.mark.slow
def test_a_truncated_cached_game_trains_after_regeneration(pristine: Path, tmp_path: Path) -> None:
    """The issue's case through the CLI: the interpreter used to end the process (exit 0, status running)."""
    _, game = _cache(pristine, tmp_path)
    _truncate(game)
    proc = run_epo(["train", "model=tiny", "env=textworld", f"env.cache_dir={tmp_path / 'cache'}",
                    *(f"env.{k}={v}" for k, v in GAME_OPTIONS.items() if k != "eval_splits"), "env.eval_splits=[]",
                    "env.max_turns=2", "algo=grpo", "algo.tasks_per_step=1", "algo.group_size=2",
                    "trainer.total_steps=1", "trainer.eval_every=0", "logger.tensorboard=false",
                    f"output_dir={tmp_path / 'runs'}"], tmp_path)
    assert "in the cache is damaged" in proc.stderr and "generating it again" in proc.stderr
    status = json.loads(next((tmp_path / "runs").glob("*/*/status.json")).read_text())
    assert status["status"] == "finished"


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_damaged_game_of_games_dir_is_refused_naming_it(damage: str, pristine: Path, tmp_path: Path) -> None:
    _, cached = _cache(pristine, tmp_path)
    games = tmp_path / "games"
    games.mkdir()
    for suffix in (".z8", ".json"):
        shutil.copy(cached.with_suffix(suffix), games / f"game_7{suffix}")
    make_damage, why = DAMAGE[damage]
    make_damage(games / GAME)
    proc = run_epo(["train", "model=tiny", "env=textworld", f"env.games_dir={games}", "env.eval_splits=[]",
                    f"output_dir={tmp_path / 'runs'}"], tmp_path, expect=None)
    assert proc.returncode != 0
    if damage == "missing json":  # the folder's listing says so first, as before
        one_error(proc, "without their .json", "game_7.z8")
    else:
        one_error(proc, f"TextWorld game {games / GAME} is damaged", why, "Fix:")
    for status_file in (tmp_path / "runs").glob("*/*/status.json"):  # a run started: it says it failed
        status = json.loads(status_file.read_text())
        assert status["status"] == "failed" and str(games) in status["error"], status


def test_a_game_damaged_during_a_run_is_refused_at_its_reset(pristine: Path, tmp_path: Path) -> None:
    """In this process (the interpreter would end it) and in a worker (its message, raised here)."""
    suite, game = _cache(pristine, tmp_path)
    suite.check()
    task = suite.sample_tasks("train", 1, random.Random(0))[0]
    _flip_one_byte(game)
    for workers in (0, 1):
        with EnvPool(suite, num_workers=workers, step_timeout_s=30) as pool, \
                pytest.raises(UserError, match=f"TextWorld game {game} is damaged: game_7.z8 differs"):
            pool.reset([task])
    before = _digests(game.parent)
    with pytest.warns(UserWarning, match="generating it again"):
        TextWorldSuite(suite.cfg).check()  # the next start generates it again
    assert _digests(game.parent) != before and game_damage(game, record=True) is None


# ---- a worker's death: one message -----------------------------------------------------------------------------


class DyingEnv(Env):
    """Its worker dies at every reset, as the interpreter's exit on a damaged story file does."""

    def reset(self, task: Task) -> tuple[str, dict[str, Any]]:
        os._exit(1)

    def step(self, action: str) -> StepResult:
        raise AssertionError("never reset")


class DyingSuite(EnvSuite):
    name = "dying"

    def make_env(self) -> Env:
        return DyingEnv()

    def sample_tasks(self, split: str, n: int, rng: random.Random, level: str | None = None) -> list[Task]:
        raise AssertionError("the test names its tasks")


@pytest.mark.parametrize("asynchronous", [False, True])
def test_a_worker_dying_at_every_reset_is_one_message(asynchronous: bool) -> None:
    task = Task("game_7.z8", "textworld", 0, "train")
    with EnvPool(DyingSuite(None), num_workers=1, step_timeout_s=30) as pool, \
            pytest.raises(EnvWorkerDied) as raised:
        if asynchronous:
            pool.start_reset([task])
            pool.collect([0])
        else:
            pool.reset([task])
    message = str(raised.value)
    assert "env worker 0 died (exit code 1) while resetting train/game_7.z8, twice" in message, message
    assert "Fix:" in message and isinstance(raised.value, UserError)
