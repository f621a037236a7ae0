"""The run config is cut into settings in one place: training/settings.py (and the Trainer's constructor,
which builds the algos components from their sections). No other module of training/ receives the config,
and the Trainer reads none after construction."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from epo_cli.compose import compose
from epo_cli.training import settings as settings_module
from epo_cli.training.engine import DistInfo

TRAINING = Path(__file__).resolve().parents[1] / "epo_cli" / "training"
ALLOWED = {"trainer.py", "settings.py"}


def config_readers(path: Path) -> list[str]:
    """Where module `path` could receive a config: an omegaconf import, or a parameter named cfg/config."""
    tree = ast.parse(path.read_text())
    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [node.module or ""] if isinstance(node, ast.ImportFrom) else [a.name for a in node.names]
            found += [f"line {node.lineno}: imports {n}" for n in names if n.split(".")[0] == "omegaconf"]
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            found += [f"line {node.lineno}: {node.name}({a.arg})" for a in node.args.args + node.args.kwonlyargs
                      if a.arg in ("cfg", "config")]
    return found


def test_no_part_of_training_receives_the_config() -> None:
    offenders = {p.name: config_readers(p) for p in sorted(TRAINING.glob("*.py")) if p.name not in ALLOWED}
    offenders = {name: where for name, where in offenders.items() if where}
    assert not offenders, f"only training/settings.py and the Trainer's constructor read the config: {offenders}"


def test_the_checker_finds_a_part_that_takes_the_config(tmp_path: Path) -> None:
    part = tmp_path / "part.py"
    part.write_text("from omegaconf import DictConfig\n\ndef build(cfg, n):\n    return cfg.algo\n")
    assert config_readers(part) == ["line 1: imports omegaconf", "line 3: build(cfg)"]


def test_the_trainer_reads_the_config_only_in_its_constructor() -> None:
    tree = ast.parse((TRAINING / "trainer.py").read_text())
    trainer = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Trainer")
    reads = [f"{fn.name} line {node.lineno}" for fn in trainer.body if isinstance(fn, ast.FunctionDef)
             and fn.name != "__init__" for node in ast.walk(fn)
             if isinstance(node, ast.Attribute) and node.attr == "cfg"
             or isinstance(node, ast.Name) and node.id == "cfg"]
    assert not reads, f"the Trainer reads its config after construction: {reads}"


@pytest.mark.parametrize("overrides", [["algo=epo"], ["algo=sft"], ["algo=ppo", "rollout.correction.mode=tis"]])
def test_settings_are_plain_frozen_data(overrides: list[str]) -> None:
    """Every part's settings are frozen dataclasses holding data (no config node, no callable)."""
    import dataclasses

    import torch
    from omegaconf import Container

    cfg = compose(overrides)
    cut = settings_module.cut_settings(cfg, DistInfo(0, 1, 0, torch.device("cpu")))

    def walk(value: object, where: str) -> None:
        assert not isinstance(value, Container), f"{where} holds a config node"
        assert not callable(value) or isinstance(value, type), f"{where} holds a live object ({value!r})"
        if dataclasses.is_dataclass(value):
            for f in dataclasses.fields(value):
                walk(getattr(value, f.name), f"{where}.{f.name}")
        elif isinstance(value, dict):
            for k, v in value.items():
                walk(v, f"{where}[{k!r}]")
        elif isinstance(value, (list, tuple)):
            for i, v in enumerate(value):
                walk(v, f"{where}[{i}]")

    for part in dataclasses.fields(cut):
        value = getattr(cut, part.name)
        if value is not None:
            assert type(value).__dataclass_params__.frozen, f"{part.name}'s settings are not frozen"
        walk(value, part.name)
    assert (cut.demos is not None) == (overrides == ["algo=sft"])
    assert cut.update.correction == cfg.rollout.correction.mode
