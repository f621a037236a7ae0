"""Every `epo` subcommand given a bad argument: a non-zero exit and a message, never a traceback."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import run_cli

# (argv, expected exit code, text the message must contain)
BAD_ARGUMENTS = [
    (["train", "bogus.key=1"], 2, "Unknown config key 'bogus'"),
    (["train", "--bogus"], 2, "is not an override"),
    (["train", "trainer.total_steps=abc"], 2, "trainer.total_steps"),
    (["eval", "episodes=abc"], 2, "episodes must be a number"),
    (["eval", "temperature=-1"], 2, "greedy=true"),
    (["eval", "run=does/not/exist"], 1, "does not exist"),
    (["eval", "policy=alien"], 2, "Unknown policy"),
    (["sweep", "algo.nonexistent=1,2"], 2, "Unknown config key"),
    (["sweep", "summarize", "does/not/exist"], 1, "does not exist"),
    (["report", "does/not/exist"], 1, "does not exist"),
    (["report", "--bogus", "x"], 2, "No such option"),
    (["config", "show", "algo=nope"], 2, "Unknown option 'nope'"),
    (["config", "show", "rollout.top_p=2"], 2, "rollout.top_p"),
    (["config", "frobnicate"], 2, "No such command"),
    (["plan", "bogus.key=1"], 2, "Unknown config key 'bogus'"),
    (["plan", "--gpus", "0"], 2, "--gpus 0"),
    (["plan", "--throughput", "does/not/exist.json"], 2, "no such file"),
    (["frobnicate"], 2, "No such command"),
]


def _commands() -> set[str]:
    """Every command and command group registered in epo_cli/cli.py, as `epo <name> [<sub>]`."""
    from epo_cli.cli import app

    names = {c.name or c.callback.__name__ for c in app.registered_commands}
    for group in app.registered_groups:
        names |= {f"{group.name} {c.name or c.callback.__name__}" for c in group.typer_instance.registered_commands}
    return names


def test_the_table_covers_every_subcommand() -> None:
    covered = {" ".join(argv[:2]) if argv[0] == "config" else argv[0] for argv, _, _ in BAD_ARGUMENTS}
    covered |= {"sweep summarize"}
    assert _commands() - covered == set(), f"subcommands without a bad-argument case: {_commands() - covered}"


@pytest.mark.slow
@pytest.mark.parametrize(("argv", "code", "text"), BAD_ARGUMENTS, ids=[" ".join(a) for a, _, _ in BAD_ARGUMENTS])
def test_bad_argument_exits_non_zero_without_a_traceback(argv: list[str], code: int, text: str,
                                                         tmp_path: Path) -> None:
    proc = run_cli(argv, cwd=tmp_path, expect=None, timeout=300)
    output = proc.stdout + proc.stderr
    assert proc.returncode == code, output
    assert "Traceback" not in output, output
    assert text in output, output
