"""The `epo` command line.

    epo train algo=epo env=household trainer.total_steps=20     train (any key is a Hydra override)
    epo config show algo=grpo                                    print the resolved config
    epo plan experiment=paper/epo_alfworld_grpo_epo_3b --gpus 8  memory per rank, fit verdict, time per iteration
    epo train --help                                             config groups and their options
"""

from __future__ import annotations

import errno
import inspect
import os
import sys
import warnings
from pathlib import Path
from typing import Any

import typer
from rich.markup import escape

from epo_cli.analysis.plan import run_plan
from epo_cli.analysis.sweep_summary import summarize_command
from epo_cli.config import GROUPS, config_dir, group_options, to_yaml
from epo_cli.errors import Stopped, UserError, err_console, file_system_message
from epo_cli.launch.deepspeed import launch_ranks
from epo_cli.launch.libraries import quiet_libraries
from epo_cli.launch.setup import compose_for_train
from epo_cli.launch.slurm import submit_slurm
from epo_cli.launch.sweep import run_sweep
from epo_cli.rundir.folder import check_resume_run_dir, claim_run_dir, release_folders
from epo_cli.rundir.saved_state import check_model_path
from epo_cli.training.stop import Interrupted, leave_at_once_on_stop_signals

# Composing a config and starting ranks need neither torch nor DeepSpeed (tests/test_imports.py checks it);
# what trains or plays in this process (epo_cli.launch.local, epo_cli.evaluation.run) and the plots
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
    claim_run_dir(cfg, args)  # this process owns the run directory until it ends (epo_cli/rundir/folder.py)
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
    from epo_cli.evaluation.run import run_eval  # torch: see the note at the imports

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
         gpu_mem: float | None = typer.Option(None, "--gpu-mem",
                                              help="GiB per GPU (per CPU rank: --device cpu); default 80."),
         device: str = typer.Option("gpu", "--device", help="gpu (bf16 where precision=auto) | cpu (fp32 ranks)."),
         throughput: str | None = typer.Option(None, "--throughput", help="scripts/gpu_check.py --out file."),
         prompt_tokens: int | None = typer.Option(None, "--prompt-tokens", help="Default: rollout.max_prompt_tokens."),
         response_tokens: int | None = typer.Option(None, "--response-tokens", help="Default: rollout.max_new_tokens."),
         as_json: bool = typer.Option(False, "--json", help="Print the plan as JSON.")) -> None:
    """Memory per rank and time per iteration of a run before it starts, whether it fits N GPUs of M GiB, and the
    single change that makes it fit: `epo plan experiment=paper/epo_alfworld_grpo_epo_3b --gpus 8 --gpu-mem 24`."""
    cfg, _ = compose_for_train(list(overrides or []))  # trainer.resume=<run>: that run's saved config
    run_plan(cfg, gpus, gpu_mem, device, throughput, prompt_tokens, response_tokens, as_json)


@config_app.command("show", context_settings=EXTRA, epilog=groups_help())
def config_show(overrides: list[str] = OVERRIDES_ARG) -> None:
    """Print the fully resolved config for these overrides (nothing runs)."""
    cfg, args = compose_for_train(list(overrides or []))
    check_resume_run_dir(cfg, args)
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
    output = sys.stdout = WatchedOutput(sys.stdout if sys.stdout is not None else closed_output())
    try:
        code = run_app(output)
        try:
            output.flush()  # here, not at exit: an output that cannot be written is one message too
        except OSError as err:
            code = output_failed(err)
        leave_at_once_on_stop_signals(0 if code is None else code if isinstance(code, int) else 1)
    finally:
        sys.stdout = output.stream
        release_folders()  # the run and sweep directories this command owned (epo_cli/rundir/folder.py)
    sys.exit(code)


def run_app(output: WatchedOutput) -> int | str | None:
    """Run the command; its exit code (a user error: one message on stderr)."""
    try:
        app()
    except SystemExit as exit_:  # typer ends every command with one
        return exit_.code
    except UserError as err:
        err_console.print("[bold red]error:[/] " + escape(str(err)), soft_wrap=True)
        return err.exit_code
    except Stopped as err:
        err_console.print("[bold yellow]stopped:[/] " + escape(str(err)), soft_wrap=True)
        return err.exit_code
    except KeyboardInterrupt:
        err_console.print("[yellow]interrupted[/]")
        return 130
    except OSError as err:  # a path the file system refused (read-only, full, a file where a folder goes...)
        if err is output.failed:
            return output_failed(err)
        message = file_system_message(err)
        if message is None:
            raise
        err_console.print("[bold red]error:[/] " + escape(message), soft_wrap=True)
        return 1
    except Interrupted as err:
        err_console.print(f"[yellow]{escape(str(err))}[/]")
        return err.exit_code
    return 0


class ClosedOutput:
    """Standard output when the shell closed it (`epo config show >&-`): every write fails as a closed file
    descriptor does, so the command ends with one message instead of an AttributeError on None."""

    encoding = "utf-8"

    def write(self, text: str) -> int:
        raise OSError(errno.EBADF, os.strerror(errno.EBADF))

    def flush(self) -> None:  # nothing was written
        pass

    def isatty(self) -> bool:
        return False


def closed_output() -> ClosedOutput:
    """A stand-in for a closed stdout; file descriptor 1 is given /dev/null, so that no file epo opens later
    takes that number and receives what is printed (nor a child process's output)."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        if devnull != 1:
            os.dup2(devnull, 1)
            os.close(devnull)
    except OSError:
        pass
    return ClosedOutput()


class WatchedOutput:
    """sys.stdout, remembering the error of a write that failed: an OSError without a file name (a full
    device, a closed pipe) is otherwise the same whether stdout or an open data file raised it."""

    def __init__(self, stream: Any) -> None:
        self.stream, self.failed = stream, None

    def write(self, text: str) -> int:
        try:
            return self.stream.write(text)
        except OSError as err:
            self.failed = err
            raise

    def flush(self) -> None:
        try:
            self.stream.flush()
        except OSError as err:
            self.failed = err
            raise

    def __getattr__(self, name: str) -> Any:  # isatty, fileno, encoding...: the stream's own
        return getattr(self.stream, name)


def output_failed(err: OSError) -> int:
    """Standard output cannot be written (full device, closed pipe): one message on stderr, exit 1; stdout
    then points at /dev/null, so that Python's own flush at exit does not print a second error."""
    if sys.__stdout__ is not None:
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.__stdout__.fileno())
            os.close(devnull)
        except (OSError, ValueError):
            pass
    if err.errno == errno.EBADF:
        err_console.print("[bold red]error:[/] the standard output is closed, and this command prints its "
                          "result there. Run it with its output open, or send it to a file or /dev/null.",
                          soft_wrap=True)
    elif err.errno != errno.EPIPE:  # a reader that closed the pipe (`| head`) wanted no more: no message
        err_console.print(f"[bold red]error:[/] cannot write to the standard output ({escape(err.strerror or '')}"
                          "): the device it goes to is full or failing. Send it to a file on a disk with space, "
                          "or to /dev/null.", soft_wrap=True)
    return 1


if __name__ == "__main__":
    main()
