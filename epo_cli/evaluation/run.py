"""Evaluate a run or a model in this process: `evaluate_run(options, overrides)` reads the run's config and
weights, plays and scores the episodes (epo_cli/evaluation/split.py, as in the trainer's periodic
evaluation), writes the results and returns them. `epo eval` (`run_eval`) is its command line: the same
options as key=value arguments, and a table on the console.

    epo eval run=outputs/<date>/<time>-<name> [checkpoint=final|latest|best|step_N] [split=S] [episodes=N]
             [temperature=0.4 | greedy=true] [policy=model|expert|look|random] [out=DIR] [any override]
    epo eval model.path=<HF folder> env=household split=eval_out_of_distribution

Weights load without DeepSpeed engines: from <run>/final (a Hugging Face folder, safetensors), or from a
checkpoint's `module` state dict (ZeRO-0: mp_rank_00_model_states.pt) or its consolidated ZeRO 1-3 shards
(deepspeed's zero_to_fp32), loaded into the model the run's config builds. Nothing from the run directory
is unpickled: checkpoint files are read with torch.load(weights_only=True) (epo_cli/rundir/safe_load.py), and the
run's saved model.trust_remote_code is not honoured (epo_cli/rundir/folder.py).

Results: <run>/eval/<name>.json, <run>/eval/<name>.samples.md (a few decoded trajectories, the trainer's
samples format) and a table on the console. Without a run they go to <output_dir>/eval/<date>_<time>/ (or
out=DIR). <name> = <final | step_N (what latest/best resolved to) | model | policy>-<split>-<t0.4 | greedy>.

The JSON (format "epo-eval/1"; EVAL_JSON_FIELDS lists the top-level keys):
    run, checkpoint, checkpoint_resolved, model_source, policy     what was evaluated
    env {name, level}, split, episodes, temperature, greedy, seed, max_turns
    success              {rate, wins, n, ci95: [lo, hi], ci_method: "wilson"}
    success_by_task_type {<task type>: same fields}
    episode_len          {mean, std, n, ci95, ci_method: "normal (mean +- 1.96 std/sqrt(n))"}
    invalid_rate         {rate, invalid_turns, turns, ci95, ci_method: "wilson over turns"}
    metrics              eval/<split>/* exactly as the trainer logs them in metrics.jsonl
    per_episode          [{task_id, task_type, won, turns, invalid_turns}]
    samples, created, command, duration_s, name, format
"""

from __future__ import annotations

import datetime
import json
import math
import pickle
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf
from rich.console import Console
from rich.table import Table

from epo_cli.analysis.memory import check_memory, episodes_estimate
from epo_cli.compose import compose, load_run_config, validate
from epo_cli.config import GROUPS, MIN_TEMPERATURE, parse_bool
from epo_cli.envs import make_suite
from epo_cli.envs.base import EnvSuite
from epo_cli.envs.pool import EnvPool
from epo_cli.errors import ConfigError, UserError
from epo_cli.evaluation.split import (
    FixedActionPolicy,
    RandomPolicy,
    eval_tasks,
    evaluate_split,
    score_episodes,
    write_samples,
)
from epo_cli.models.attention import check_attention
from epo_cli.models.loading import (
    apply_lora,
    check_context,
    load_causal_lm,
    load_tokenizer,
    model_source,
    resolve_dtype,
    weight_name_problem,
)
from epo_cli.rollout.engines.build import evaluation_policy
from epo_cli.rollout.episodes import Episode, ExpertPolicy, Policy
from epo_cli.rollout.prompts import PromptBuilder, chat_encoder
from epo_cli.rundir.checkpoint_paths import resolve_checkpoint
from epo_cli.rundir.folder import lock_folder, override_keys
from epo_cli.rundir.safe_load import load_tensors, refused_message, restricted_torch_load
from epo_cli.rundir.saved_state import check_model_path
from epo_cli.rundir.writable import check_output_dir, json_ready, write_file
from epo_cli.runtime.device import pick_device

#: the documented top-level fields of an eval JSON (tests check them)
EVAL_JSON_FIELDS = (
    "format", "name", "created", "command", "run", "checkpoint", "checkpoint_resolved", "model_source",
    "policy", "env", "split", "episodes", "temperature", "greedy", "seed", "max_turns", "success",
    "success_by_task_type", "episode_len", "invalid_rate", "metrics", "per_episode", "samples", "duration_s",
)
EVAL_FORMAT = "epo-eval/1"

POLICIES = ("model", "expert", "look", "random")


# ----------------------------------------------------------------------------------------------------
# `epo eval`: arguments, config, weights
# ----------------------------------------------------------------------------------------------------

@dataclass
class EvalCommandConfig:
    """One evaluation's options: `epo eval`'s key=value arguments, or evaluate_run's first argument."""

    run: Path | None = None
    checkpoint: str | None = None  # final | latest | best | step_N (default: final if present, else latest)
    split: str | None = None
    episodes: int | None = None
    temperature: float | None = None
    greedy: bool = False
    policy: str = "model"
    out: Path | None = None


EVAL_KEYS = {f for f in EvalCommandConfig.__dataclass_fields__}


def unquoted(value: str) -> str:
    """A value in matching single or double quotes (Hydra's way to quote a path with spaces) without them."""
    if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
        return value[1:-1]
    return value


def whole_number(value: str) -> int:
    """An integer written as 1000, 1e6 or 1_000 (ValueError for 2.5 or text)."""
    try:
        return int(value)
    except ValueError:
        number = float(value)
        if not number.is_integer():
            raise ValueError(value) from None
        return int(number)


def parse_eval_args(args: list[str]) -> tuple[EvalCommandConfig, list[str]]:
    """Split `key=value` arguments into eval options and config overrides (everything else); their rules are
    evaluate_run's (check_eval_options)."""
    opts, overrides = EvalCommandConfig(), []
    for arg in args:
        key, sep, value = arg.partition("=")
        if not sep or key not in EVAL_KEYS:
            overrides.append(arg)
            continue
        value = unquoted(value)  # run='/my runs/x' (Hydra's quoting, as for config values): the path inside
        if not value.strip():  # `split=` would otherwise mean "the default split" without a word
            raise ConfigError(f"{key}= has no value. Give one ({key}=<value>), or leave {key} out for its "
                              "default.")
        try:
            if key in ("run", "out"):
                setattr(opts, key, Path(value).expanduser())
            elif key == "episodes":
                opts.episodes = whole_number(value)
            elif key == "temperature":
                opts.temperature = float(value)
            elif key == "greedy":
                opts.greedy = parse_bool(key, value)  # the one rule for true/false settings (config.py)
            else:
                setattr(opts, key, value)
        except ValueError:
            raise ConfigError(f"{arg}: {key} must be a number.") from None
    return opts, overrides


def check_eval_options(opts: EvalCommandConfig, overrides: list[str]) -> None:
    """The options' own rules (ConfigError), checked by evaluate_run before anything is read: options from the
    command line and from a script are held to the same rules."""
    if opts.policy not in POLICIES:
        raise ConfigError(f"Unknown policy '{opts.policy}'. Valid: {', '.join(POLICIES)} (model = the "
                          "trained policy; expert, look and random are scripted baselines).")
    if opts.episodes is not None and opts.episodes < 1:
        raise ConfigError(f"episodes must be >= 1 (got {opts.episodes}).")
    if opts.checkpoint is not None and opts.run is None:
        raise ConfigError("checkpoint= needs run=<run dir> (with model.path=DIR the folder is the model).")
    path = next((o.split("=", 1)[1] for o in overrides if o.split("=", 1)[0].lstrip("+") == "model.path"), None)
    # a scripted policy (expert|look|random) reads only a tokenizer, which model.path may name beside run=
    if opts.policy == "model" and opts.run is not None and path not in (None, "null", "None"):
        raise ConfigError(f"run= and model.path= both name the weights to evaluate (run={opts.run}, model.path="
                          f"{path}); run= evaluates the run's own. Pass one: run=<run dir> [checkpoint=...], or "
                          "model.path=<HF folder> with the run's settings as overrides.")
    if opts.greedy and opts.temperature is not None:
        raise ConfigError("Pass either greedy=true or temperature=T, not both.")
    if opts.temperature is not None and not (opts.temperature >= MIN_TEMPERATURE and math.isfinite(opts.temperature)):
        raise ConfigError(f"temperature={opts.temperature:g} is out of range; allowed: {MIN_TEMPERATURE:g} <= value "
                          "(below it, logits / temperature overflow float32). For greedy decoding pass greedy=true.")


def eval_config(opts: EvalCommandConfig, overrides: list[str]) -> DictConfig:
    """The run's saved config with the overrides on top (group overrides such as env=... swap the whole
    group for that option's defaults), or a freshly composed config when no run is given."""
    if opts.run is None:
        return compose(overrides)
    if opts.run.exists() and not opts.run.is_dir():
        raise UserError(f"run={opts.run} is a file, not a run directory. Pass the folder `epo train` made, e.g. "
                        "run=outputs/<date>/<time>-<name>, or evaluate a model folder with model.path=DIR.")
    if not opts.run.is_dir():
        raise UserError(f"Run directory '{opts.run}' does not exist. Pass the folder `epo train` made, e.g. "
                        "run=outputs/<date>/<time>-<name>, or evaluate a model folder with model.path=DIR.")
    base = load_run_config(opts.run, overridden=override_keys(overrides))
    groups = [o for o in overrides if o.split("=", 1)[0] in GROUPS]
    presets = [o for o in groups if o.split("=", 1)[0] == "experiment"]
    if presets:  # a preset sets many sections at once (no `experiment` section to swap): not a run's to change
        raise ConfigError(f"{presets[0]}: an experiment preset sets a whole training config, and run={opts.run} is "
                          "evaluated with its own. Fix: leave it out and override what the evaluation changes "
                          "(env=..., split=..., episodes=...), or evaluate a model folder with model.path=DIR "
                          f"{presets[0]}.")
    rest = [o for o in overrides if o not in groups]
    plain = OmegaConf.create(OmegaConf.to_container(base, resolve=True))
    if groups:
        fresh = compose(groups)
        for o in groups:
            key = o.split("=", 1)[0]
            plain[key] = OmegaConf.to_container(fresh[key], resolve=True)
    try:
        merged = OmegaConf.merge(plain, OmegaConf.from_dotlist(rest))
    except Exception as err:  # noqa: BLE001 - a malformed override is the user's to fix
        raise ConfigError(f"Invalid override: {err}") from None
    return validate(merged)


def _read_checkpoint_state(ckpt: Path) -> dict[str, Any]:
    """The model's state dict from a DeepSpeed checkpoint folder, without building an engine and without
    unpickling: every file goes through the restricted unpickler (torch.load(weights_only=True)), so a
    crafted pickle in a shared run directory is refused instead of run."""
    try:
        if any(ckpt.glob("*zero_pp_rank_*_optim_states.pt")):  # ZeRO 1-3: consolidate the fp32 shards
            # lazy: deepspeed is slow to import and only ZeRO 1-3 checkpoints need it
            from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

            with restricted_torch_load():
                return get_fp32_state_dict_from_zero_checkpoint(str(ckpt.parent), tag=ckpt.name)
        return load_tensors(ckpt / "mp_rank_00_model_states.pt")["module"]
    except UserError as err:  # the restricted unpickler refused a file (it names it)
        raise UserError(f"{err} Evaluate another checkpoint (checkpoint=final, checkpoint=best or "
                        f"checkpoint=step_N; see {ckpt.parent}).", exit_code=err.exit_code) from None
    except pickle.UnpicklingError as err:
        raise UserError(refused_message(ckpt, err) + " Evaluate another checkpoint (checkpoint=final, "
                        f"checkpoint=best or checkpoint=step_N; see {ckpt.parent}).") from None
    except Exception as err:  # noqa: BLE001 - any failure to read is the same user-facing problem
        first = str(err).splitlines()[0] if str(err) else ""
        raise UserError(f"Checkpoint '{ckpt}' is corrupt or unreadable ({type(err).__name__}: {first}). "
                        "Evaluate another one: checkpoint=final, checkpoint=best or checkpoint=step_N "
                        f"(see {ckpt.parent}).") from None


def _load_state(model: Any, state: dict[str, Any], ckpt: Path) -> None:
    expected = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    wrong = [f"{name} is {list(t.shape)} there and {list(expected[name])} here" for name, t in state.items()
             if name in expected and hasattr(t, "shape") and tuple(t.shape) != expected[name]]
    if wrong:  # another model shape (e.g. a model.hidden_size override): load_state_dict would raise
        raise UserError(f"Checkpoint '{ckpt}' holds a model of another shape than this run's config builds "
                        f"({len(wrong)} tensors differ, e.g. {'; '.join(wrong[:2])}). Evaluate it without the "
                        "model overrides, with those the run was trained with, or evaluate checkpoint=final.")
    missing, unexpected = model.load_state_dict(state, strict=False)
    # the model's own rules excuse a name (a weight it ties to one the file holds), as for a model folder;
    # under LoRA the rules are the base model's, and its names lack PEFT's prefix
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    names = {"missing_keys": [k.removeprefix("base_model.model.") for k in missing],
             "unexpected_keys": [k.removeprefix("base_model.model.") for k in unexpected]}
    problem = weight_name_problem(base, names)
    if problem is not None:
        raise UserError(f"Checkpoint '{ckpt}' does not fit the model of this run's config: {problem}. Evaluate "
                        "checkpoint=final, or pass the model overrides the run was trained with.")


def load_model(cfg: DictConfig, suite: EnvSuite, run: Path | None, which: str, device: Any
               ) -> tuple[Any, Any, str, str | None]:
    """(model, tokenizer, model source, resolved checkpoint tag) for run/checkpoint or model.path."""
    dtype = resolve_dtype(cfg.model, device)
    if run is None or which == "final":
        source = str(run / "final") if run is not None else model_source(cfg.model, suite, cfg.seed)
        if run is not None and not (run / "final" / "config.json").exists():
            raise UserError(f"'{run}' has no final/ model (the run did not finish). Evaluate a checkpoint "
                            "instead: checkpoint=latest, checkpoint=best or checkpoint=step_N.")
        model = load_causal_lm(source, cfg.model, dtype)
        return model.to(device).eval(), load_tokenizer(source, cfg.model), source, None
    ckpt = resolve_checkpoint(run, which)
    source = model_source(cfg.model, suite, cfg.seed)  # the architecture (and tokenizer) the run trained
    state = _read_checkpoint_state(ckpt)
    model = apply_lora(load_causal_lm(source, cfg.model, dtype), cfg.model.lora)
    _load_state(model, state, ckpt)
    if hasattr(model, "merge_and_unload"):
        model = model.merge_and_unload()
    return model.to(device).eval(), load_tokenizer(source, cfg.model), source, ckpt.name


# ----------------------------------------------------------------------------------------------------
# evaluate_run, and `epo eval` around it
# ----------------------------------------------------------------------------------------------------

def eval_name(label: str, split: str, temperature: float) -> str:
    return f"{label}-{split}-{'greedy' if temperature <= 0 else f't{temperature:g}'}"


@dataclass
class PolicyInfo:
    label: str  # file-name prefix: final | step_N | model | expert | look | random
    checkpoint: str | None = None  # as asked (final | latest | best | step_N)
    resolved: str | None = None  # the step_N that latest/best named
    source: str | None = None  # the model folder or hub id the weights and tokenizer came from


def build_policy(opts: EvalCommandConfig, cfg: DictConfig, suite: EnvSuite, temperature: float, device: Any
                 ) -> tuple[Policy, Any, PolicyInfo]:
    """The policy to evaluate (the trained model, or a scripted baseline), its tokenizer, and what it is."""
    if opts.policy != "model":  # scripted: only the tokenizer (prompts and responses are still tokens)
        final = opts.run / "final" if opts.run is not None else None
        source = str(final) if final is not None and (final / "config.json").exists() else \
            model_source(cfg.model, suite, cfg.seed)
        tokenizer = load_tokenizer(source, cfg.model)
        scripted = {"expert": ExpertPolicy, "look": FixedActionPolicy, "random": RandomPolicy}
        return scripted[opts.policy](tokenizer), tokenizer, PolicyInfo(opts.policy, source=source)
    has_final = opts.run is not None and (opts.run / "final" / "config.json").exists()
    which = opts.checkpoint or ("final" if has_final or opts.run is None else "latest")
    model, tokenizer, source, resolved = load_model(cfg, suite, opts.run, which, device)
    check_context(model, cfg.rollout.max_prompt_tokens, cfg.rollout.max_new_tokens, source)
    policy = evaluation_policy(model, tokenizer, cfg, source, temperature)  # through rollout.engine
    # latest/best move as training goes on: name the file after the step they resolved to
    label = (resolved or which) if opts.run is not None else "model"
    return policy, tokenizer, PolicyInfo(label, which if opts.run is not None else None, resolved or which,
                                         source)


@dataclass
class EvalResult:
    """What evaluate_run measured and wrote."""

    payload: dict[str, Any]  # the eval JSON's fields (EVAL_JSON_FIELDS), as written to `path`
    path: Path  # <out>/<name>.json
    episodes: list[Episode]  # the episodes played, in task order

    @property
    def success_rate(self) -> float:
        return self.payload["success"]["rate"]


def run_eval(args: list[str]) -> EvalResult:
    """`epo eval ARGS`: evaluate_run with the options and overrides of the command line, then a table."""
    opts, overrides = parse_eval_args(args)
    result = evaluate_run(opts, overrides, command=" ".join(["epo", *sys.argv[1:]]))
    print_eval(result.payload, result.path)
    return result


def evaluate_run(opts: EvalCommandConfig, overrides: Sequence[str] = (), command: str | None = None) -> EvalResult:
    """Evaluate `opts.run` (its checkpoint `opts.checkpoint`, default final) or `model.path=` in `overrides`, or a
    scripted policy, on `opts.episodes` fixed tasks of `opts.split`, in this process; write <out>/<name>.json
    and <name>.samples.md (module docstring) and return them. `overrides` are config overrides on top of the
    run's saved config, as on `epo eval`'s command line; `command` is recorded in the JSON (default: this
    process's command line). Bad options or settings raise UserError / ConfigError before anything is played.
    Torch's thread count is set to the config's trainer.num_threads for this process."""
    started = time.perf_counter()
    overrides = list(overrides)
    check_eval_options(opts, overrides)
    cfg = eval_config(opts, overrides)
    torch.set_num_threads(cfg.trainer.num_threads)
    suite = make_suite(cfg.env)
    split = opts.split or (cfg.env.eval_splits[0] if cfg.env.eval_splits else "eval_in_distribution")
    if split not in suite.splits:
        raise ConfigError(f"Unknown split '{split}' for env={cfg.env.name}. Valid splits: "
                          f"{', '.join(suite.splits)}. Fix: split=<one of them>.")
    if opts.run is None and opts.policy == "model":
        check_model_path(cfg.model)  # a model folder from elsewhere (or a file): checked before any work
    if opts.policy == "model" and opts.run is None and not cfg.model.path:
        raise UserError("Nothing to evaluate: pass run=<run dir> (a trained run) or model.path=<HF folder>; "
                        "policy=expert|look|random evaluates a scripted baseline.")
    episodes_n = opts.episodes or cfg.trainer.eval_episodes
    check_memory(cfg, [episodes_estimate(episodes_n, cfg, "episodes")],  # before any task is drawn
                 eval_rows=episodes_n if opts.policy == "model" else None)  # the model generates for them all
    suite.check()
    temperature = 0.0 if opts.greedy else (opts.temperature if opts.temperature is not None
                                          else cfg.rollout.eval_temperature)

    out = check_output_dir(opts.out or ((opts.run / "eval") if opts.run is not None else Path(cfg.output_dir)
                             / "eval" / datetime.datetime.now().strftime("%Y-%m-%d_%H-%M-%S")), "out")
    # one writer per output folder, as for run dirs: a second `epo eval` into it is refused, not mixed in
    lock_folder(out, "eval output folder", walk=False)
    device = pick_device(cfg.trainer.device, local_rank=0)
    if opts.policy == "model":
        check_attention(cfg.model, device.type)
    policy, tokenizer, info = build_policy(opts, cfg, suite, temperature, device)

    # --- play and score ----------------------------------------------------------------------------------
    builder = PromptBuilder(cfg.env.prompt_template, cfg.env.history_length, cfg.rollout.max_prompt_tokens,
                            chat_encoder(tokenizer, cfg.env.system_prompt))
    tasks = eval_tasks(suite, split, episodes_n, cfg.seed)
    # the envs' expert (env.expert=null) runs only when it is the policy being scored
    pool = EnvPool(suite, num_workers=cfg.env.num_workers, step_timeout_s=cfg.env.step_timeout_s,
                   reads_expert=opts.policy == "expert")
    try:
        with torch.no_grad():
            metrics, episodes = evaluate_split(policy, pool, builder, tokenizer, split, tasks,
                                               list(range(len(tasks))), cfg.env.max_turns, cfg.seed,
                                               overlap=cfg.rollout.overlap)
    finally:
        pool.close()

    # --- write -------------------------------------------------------------------------------------------
    name = eval_name(info.label, split, temperature)
    out.mkdir(parents=True, exist_ok=True)
    samples = out / f"{name}.samples.md"
    write_samples(samples, episodes[: max(cfg.rollout.num_samples_to_save, 1)])
    payload: dict[str, Any] = {
        "format": EVAL_FORMAT,
        "name": name,
        "created": datetime.datetime.now().isoformat(timespec="seconds"),
        "command": command if command is not None else " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "run": str(opts.run) if opts.run is not None else None,
        "checkpoint": info.checkpoint,
        "checkpoint_resolved": info.resolved if info.checkpoint else None,
        "model_source": info.source,
        "policy": opts.policy,
        "engine": cfg.rollout.engine if opts.policy == "model" else None,  # what generated (rollout.engine)
        "env": {"name": cfg.env.name, **({"level": cfg.env.level} if "level" in cfg.env else {})},
        "split": split,
        "episodes": len(episodes),
        "temperature": temperature,
        "greedy": temperature <= 0,
        "seed": cfg.seed,
        "max_turns": cfg.env.max_turns,
        **score_episodes(episodes),
        "metrics": metrics,
        "per_episode": [{"task_id": ep.task.task_id, "task_type": ep.task.task_type, "won": ep.won,
                         "turns": len(ep.turns), "invalid_turns": sum(not t.valid for t in ep.turns)}
                        for ep in episodes],
        "samples": str(samples),
        "duration_s": round(time.perf_counter() - started, 2),
    }
    path = out / f"{name}.json"
    write_file(path, json.dumps(json_ready(payload), indent=2, allow_nan=False, default=str))  # no symlink followed
    return EvalResult(payload, path, episodes)


def print_eval(payload: dict[str, Any], path: Path) -> None:
    def ci(item: dict[str, Any], pct: bool = True) -> str:
        lo, hi = item["ci95"]
        return f"[{lo:.1%}, {hi:.1%}]" if pct else f"[{lo:.2f}, {hi:.2f}]"

    what = (payload["checkpoint_resolved"] or payload["model_source"]) if payload["policy"] == "model" \
        else f"policy={payload['policy']}"
    table = Table(title=f"eval {what} on {payload['env']['name']}/{payload['split']} "
                        f"({payload['episodes']} episodes, temperature {payload['temperature']:g})")
    table.add_column("metric")
    table.add_column("value", justify="right")
    table.add_column("95% interval", justify="right")
    s = payload["success"]
    table.add_row("success", f"{s['rate']:.1%} ({s['wins']}/{s['n']})", ci(s) + " wilson")
    for task_type, item in payload["success_by_task_type"].items():
        table.add_row(f"  success/{task_type}", f"{item['rate']:.1%} ({item['wins']}/{item['n']})", ci(item))
    e = payload["episode_len"]
    table.add_row("episode length", f"{e['mean']:.2f}", ci(e, pct=False))
    i = payload["invalid_rate"]
    table.add_row("invalid-action rate", f"{i['rate']:.1%}", ci(i) + " (turns)")
    console = Console(highlight=False)
    console.print(table)
    console.print(f"results: {path}\nsamples: {payload['samples']}")
