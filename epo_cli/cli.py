"""The `epo` command line.

    epo train algo=epo env=household trainer.total_steps=20     train (any key is a Hydra override)
    epo config show algo=grpo                                    print the resolved config
    epo plan experiment=paper/epo_alfworld_grpo_epo_3b --gpus 8  memory per rank, fit verdict, time per iteration
    epo train --help                                             config groups and their options
"""

from __future__ import annotations

import inspect
import sys
import warnings
from pathlib import Path
from typing import Any

import typer
from rich.markup import escape

from epo_cli.analysis.plan import run_plan
from epo_cli.analysis.sweep_summary import summarize_command
from epo_cli.config import GROUPS, config_dir, group_options, to_yaml
from epo_cli.console import err_console, quiet_libraries
from epo_cli.errors import Stopped, UserError, file_system_message
from epo_cli.launch.deepspeed import launch_ranks
from epo_cli.launch.setup import compose_for_train
from epo_cli.launch.slurm import submit_slurm
from epo_cli.launch.sweep import run_sweep
from epo_cli.saved_state import check_model_path
from epo_cli.training.stop import Interrupted

# Composing a config and starting ranks need neither torch nor DeepSpeed (tests/test_imports.py checks it);
# what trains or plays in this process (epo_cli.launch.local, epo_cli.eval_command) and the plots
# (epo_cli.analysis.report: numpy, matplotlib) are imported inside their commands, when they run.


def groups_help() -> str:
    """'Config groups' block of the help text, read from conf/ (so it is always current)."""
    lines = ["Config groups (pick one option with group=option):\n\n"]
    for group in GROUPS:
        if (config_dir() / group).is_dir():
            folders = [d.name for d in sorted((config_dir() / group).iterdir()) if d.is_dir()]
            nested = [f"{name}/<{len(group_options(f'{group}/{name}'))} presets>" for name in folders
                      if group_options(f"{group}/{name}")]  # e.g. experiment=paper/<name> (docs/recipes.md)
            lines.append(f"  {group:<11} {', '.join(group_options(group) + nested) or '-'}\n\n")
    lines.append("Any key can be overridden: trainer.total_steps=20 seed=3 model.hidden_size=128 "
                 "algo.entropy_smoothing.alpha=0.05. See every key with `epo config show`.")
    return "".join(lines)


app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,  # bugs keep their plain traceback; user errors are one message
    help="Train LLM agents with RL on long, multi-turn, sparse-reward tasks (EPO, PPO, GRPO).",
    epilog=groups_help(),
)
config_app = typer.Typer(no_args_is_help=True, help="Inspect configs.")
app.add_typer(config_app, name="config")

OVERRIDES_ARG = typer.Argument(None, help="Hydra overrides: group=option or section.key=value.",
                               show_default=False)
EXTRA = {"allow_extra_args": True, "ignore_unknown_options": True}


@app.command(context_settings=EXTRA, epilog=groups_help())
def train(overrides: list[str] = OVERRIDES_ARG) -> None:
    """Train a policy: `epo train algo=epo env=household`."""
    cfg, args = compose_for_train(list(overrides or []))
    check_model_path(cfg.model)  # a model folder from elsewhere: checked before a run directory is written
    if cfg.launcher.name == "local":
        from epo_cli.launch.local import run_local  # the Trainer (torch): see the note at the imports

        run_local(cfg, args)
    elif cfg.launcher.name == "slurm":
        submit_slurm(cfg, args)
    else:
        launch_ranks(cfg, args)


@app.command("eval", context_settings=EXTRA)
def eval_command(overrides: list[str] = OVERRIDES_ARG) -> None:
    """Evaluate a run or a model: `epo eval run=<run dir> [checkpoint=best split=S episodes=N greedy=true]`.

    Options: run, checkpoint (final|latest|best|step_N), split, episodes, temperature, greedy,
    policy (model|expert|look|random), out; any other key=value is a config override."""
    from epo_cli.eval_command import run_eval  # torch: see the note at the imports

    run_eval(list(overrides or []))


@app.command(context_settings=EXTRA)
def sweep(overrides: list[str] = OVERRIDES_ARG) -> None:
    """Many runs through Hydra multirun: `epo sweep algo=grpo,epo seed=0,1,2` (comma lists, range(a,b),
    hydra/launcher=joblib|submitit_slurm, hydra/sweeper=optuna with sweep.metric and sweep.direction).
    `epo sweep summarize <sweep_dir>` rebuilds the summary table of a (possibly interrupted) sweep."""
    args = list(overrides or [])
    if args and args[0] == "summarize":
        summarize_command(args[1:])
    else:
        run_sweep(args)


REPORT_PATHS = typer.Argument(..., help="Run directories and/or sweep directories.", metavar="DIR...",
                              show_default=False)
REPORT_OUT = typer.Option(None, "--out", help="Output folder (default: <first dir>/plots).")


@app.command()
def report(paths: list[str] = REPORT_PATHS, out: str | None = REPORT_OUT) -> None:
    """PNG plots (entropy with EPO's band, fluctuation, success, KL, coefficients, lr) and an index page."""
    from epo_cli.analysis.report import run_report  # torch, numpy: see the note at the imports

    run_report([Path(p) for p in paths], Path(out) if out else None)


@app.command(context_settings=EXTRA)
def plan(overrides: list[str] = OVERRIDES_ARG,
         gpus: int | None = typer.Option(None, "--gpus", help="GPUs in all (default: the launcher's world size)."),
         gpu_mem: float | None = typer.Option(None, "--gpu-mem", help="GiB per GPU (default 80)."),
         device: str = typer.Option("gpu", "--device", help="gpu (bf16 where precision=auto) | cpu (fp32 ranks)."),
         throughput: str | None = typer.Option(None, "--throughput", help="scripts/gpu_check.py --out file."),
         prompt_tokens: int | None = typer.Option(None, "--prompt-tokens", help="Default: rollout.max_prompt_tokens."),
         response_tokens: int | None = typer.Option(None, "--response-tokens", help="Default: rollout.max_new_tokens."),
         as_json: bool = typer.Option(False, "--json", help="Print the plan as JSON.")) -> None:
    """Memory per rank and time per iteration of a run before it starts, whether it fits N GPUs of M GiB, and the
    single change that makes it fit: `epo plan experiment=paper/epo_alfworld_grpo_epo_3b --gpus 8 --gpu-mem 24`."""
    run_plan(list(overrides or []), gpus, gpu_mem, device, throughput, prompt_tokens, response_tokens, as_json)


@config_app.command("show", context_settings=EXTRA, epilog=groups_help())
def config_show(overrides: list[str] = OVERRIDES_ARG) -> None:
    """Print the fully resolved config for these overrides (nothing runs)."""
    cfg, _ = compose_for_train(list(overrides or []))
    sys.stdout.write(to_yaml(cfg))


def literal_help(*apps: typer.Typer) -> None:
    """Each command's help is its docstring shown as written: typer renders help with rich, which would read
    `[checkpoint=best split=S]` as a markup tag and drop it, so square brackets are escaped."""
    for typer_app in apps:
        for info in typer_app.registered_commands:
            if info.help is None and info.callback is not None:
                info.help = escape(inspect.getdoc(info.callback) or "")


literal_help(app, config_app)


def _show_warning(message: Warning | str, category: type[Warning], filename: str, lineno: int,
                  file: Any = None, line: str | None = None) -> None:
    """epo's own warnings as one line on stderr, like its errors; other packages' as Python shows them
    (written here, as Python's default does: whatever warnings.showwarning was when this module was
    imported, e.g. a test runner's recorder, is not what a user's process has)."""
    if not filename.startswith(str(Path(__file__).parent)):
        try:
            (file or sys.stderr).write(warnings.formatwarning(message, category, filename, lineno, line))
        except OSError:  # stderr gone: nothing to show it on, as in Python's own showwarning
            pass
        return
    err_console.print("[bold yellow]warning:[/] " + escape(str(message)), soft_wrap=True)


def main() -> None:
    quiet_libraries()
    warnings.showwarning = _show_warning
    try:
        app()
    except UserError as err:
        err_console.print("[bold red]error:[/] " + escape(str(err)), soft_wrap=True)
        sys.exit(err.exit_code)
    except Stopped as err:
        err_console.print("[bold yellow]stopped:[/] " + escape(str(err)), soft_wrap=True)
        sys.exit(err.exit_code)
    except KeyboardInterrupt:
        err_console.print("[yellow]interrupted[/]")
        sys.exit(130)
    except OSError as err:  # a path the file system refused (read-only, full, a file where a folder goes...)
        message = file_system_message(err)
        if message is None:
            raise
        err_console.print("[bold red]error:[/] " + escape(message), soft_wrap=True)
        sys.exit(1)
    except Interrupted as err:
        err_console.print(f"[yellow]{escape(str(err))}[/]")
        sys.exit(err.exit_code)


if __name__ == "__main__":
    main()
