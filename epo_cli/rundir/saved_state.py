"""A run's saved state is checked whole before it is used, or refused with one message.

    config.yaml          every section and key of the schemas present (a file cut short is not completed
                         from the defaults), then the same types and ranges as on the command line (validate)
    trainer_state.json   a JSON object of epo's checkpoint format; trainer.step an int >= 0 that matches the
                         checkpoint folder's step_N and its COMPLETE marker; the counters and the state of
                         each part (entropy history, monitor, schedule, curriculum) of the right kinds; what
                         wrote it (`written_by`: algo, critic, model shape), compared with the resuming run by
                         epo_cli/training/checkpoint.py
    resuming             the checkpoint's step below trainer.total_steps (else nothing would train); with
                         trainer.resume=auto, the command's config-group selections agree with the run
    YAML files           (config.yaml, .hydra/overrides.yaml) at most MAX_YAML_BYTES, and their aliases
                         expand to at most MAX_YAML_VALUES values (an alias bomb is refused, not expanded)
    a model folder       (model.path=, a run's final/) config.json and tokenizer files readable and of the
                         shape transformers needs, no auto_map without model.trust_remote_code=true on the
                         command line, safetensors headers whole, the embedding's shape that of config.json

Torch-free: `epo train` checks all of it before the run directory is touched or any rank starts.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import struct
from collections.abc import Iterator, Mapping
from dataclasses import MISSING, fields, is_dataclass
from pathlib import Path
from typing import Any

import yaml
from omegaconf import DictConfig, ListConfig, OmegaConf

from epo_cli.config import RunConfig
from epo_cli.envs import ENV_SUITES, env_config_class
from epo_cli.errors import ConfigError, UserError
from epo_cli.rundir.received import (
    LIMITS,
    ReceivedFileError,
    check_regular,
    loads,
    model_folder_root,
    read_json,
    read_prefix,
    read_text,
)

#: written into trainer_state.json by epo_cli.training.checkpoint.save
CHECKPOINT_FORMAT = "epo-checkpoint/2"
#: keys added to the schemas after runs were saved without them: filled from their defaults (a key added to
#: the schemas goes here, so that older runs still resume and evaluate with the behaviour they were saved with)
ADDED_KEYS: tuple[str, ...] = (
    "rollout.correction.mode",  # default none: the loss of a run saved before it had no correction
    "model.autocast",  # default none: a run saved before it ran every forward at its weights' dtype
)


# ---- config.yaml ---------------------------------------------------------------------------------------------

def _expected_keys(schema: type, prefix: str = "") -> list[str]:
    """Every dotted key of `schema` (nested sections walked; dict-valued fields are one key)."""
    out = []
    for f in fields(schema):
        made = f.default_factory() if f.default_factory is not MISSING else None  # type: ignore[misc]
        if is_dataclass(made):
            out.append(prefix + f.name)
            out += _expected_keys(type(made), f"{prefix}{f.name}.")
        else:
            out.append(prefix + f.name)
    return out


def check_saved_config(raw: DictConfig, path: Path) -> None:
    """Every section and key of the schemas (the env's by env.name) must be in a saved config: a file cut
    short would otherwise be completed silently from today's defaults. One UserError listing what is missing."""
    env_name = OmegaConf.select(raw, "env.name", default=None)
    if env_name not in ENV_SUITES:
        raise UserError(f"'{path}' is not a complete run config: env.name is "
                        f"{'missing' if env_name is None else repr(env_name)} (one of {', '.join(ENV_SUITES)}). "
                        "Nothing was loaded; restore the file from a copy of the run.")
    expected = [k for k in _expected_keys(RunConfig) if k != "env" and not k.startswith("env.")]
    expected += ["env"] + [f"env.{k}" for k in _expected_keys(env_config_class(str(env_name)))]
    missing = [k for k in expected if k not in ADDED_KEYS and OmegaConf.select(raw, k, default=MISSING) is MISSING]
    if missing:
        sections = sorted({k.split(".")[0] for k in missing})
        raise UserError(f"'{path}' is not a complete run config: {len(missing)} setting(s) are missing (e.g. "
                        f"{', '.join(missing[:5])}; in {', '.join(sections)}), as in a file cut short. Nothing "
                        "was loaded or taken from the defaults; restore the file from a copy of the run.")


# ---- YAML files from elsewhere --------------------------------------------------------------------------------

#: the largest YAML file of a run epo reads (a run's config.yaml is about 10 KB)
MAX_YAML_BYTES = LIMITS["run config"]
#: the most values (mappings, lists, keys and scalars) a YAML file may stand for once its aliases are expanded
MAX_YAML_VALUES = 200_000
#: the deepest a YAML file of a run may nest (a run's config.yaml nests 4 levels; OmegaConf recurses per level)
MAX_YAML_DEPTH = 32


def _nesting(root: yaml.Node) -> int:
    """How deep `root` nests (aliases followed: a shared node is measured once), walked without recursion so
    that a file nested thousands deep is measured, not a RecursionError. ValueError for an alias cycle."""
    heights: dict[int, int] = {}
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    open_nodes: set[int] = set()
    while stack:
        node, done = stack.pop()
        children = [c for kv in node.value for c in kv] if isinstance(node, yaml.MappingNode) else \
            list(node.value) if isinstance(node, yaml.SequenceNode) else []
        if done:
            heights[id(node)] = 1 + max((heights[id(c)] for c in children), default=0)
            open_nodes.discard(id(node))
            if heights[id(node)] > MAX_YAML_DEPTH:
                return heights[id(node)]
            continue
        if id(node) in heights:
            continue
        if id(node) in open_nodes:
            raise ValueError("an alias (*name) refers to a node that contains it")
        open_nodes.add(id(node))
        stack.append((node, True))
        stack.extend((c, False) for c in children if id(c) not in heights)
    return heights[id(root)]


def _expanded_values(node: yaml.Node, sizes: dict[int, int], open_nodes: set[int]) -> int:
    """How many values `node` stands for with every alias expanded; memoised per node, so a node that many
    aliases name is counted in one pass. ValueError for an alias inside its own anchor (a cycle)."""
    if id(node) in sizes:
        return sizes[id(node)]
    if id(node) in open_nodes:
        raise ValueError("an alias (*name) refers to a node that contains it")
    open_nodes.add(id(node))
    total = 1
    if isinstance(node, yaml.SequenceNode):
        total += sum(_expanded_values(child, sizes, open_nodes) for child in node.value)
    elif isinstance(node, yaml.MappingNode):
        total += sum(_expanded_values(k, sizes, open_nodes) + _expanded_values(v, sizes, open_nodes)
                     for k, v in node.value)
    open_nodes.discard(id(node))
    sizes[id(node)] = total
    return total


def load_yaml(path: Path) -> DictConfig | ListConfig:
    """A YAML file of a run, read with OmegaConf's safe loader (a !!python tag is an error, never run) once
    its size is known to be bounded: at most MAX_YAML_BYTES, and at most MAX_YAML_VALUES values with its
    aliases expanded. An alias bomb ("billion laughs": ten lines whose nested *aliases stand for a billion
    strings) would otherwise keep OmegaConf copying values for minutes, memory growing. The size is counted
    on the composed node graph, where an alias is one shared node, so counting costs what the file's text
    does. Raises ValueError (or yaml's own error) naming what is wrong; callers add the file and the fix."""
    try:  # a regular file of at most MAX_YAML_BYTES (a FIFO would hang, /dev/zero never end)
        text = read_text(path, "run config", within=Path(path).parent)
    except ReceivedFileError as err:
        raise ValueError(err.reason) from None
    root = yaml.compose(text, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))  # libyaml where built
    if root is not None and _nesting(root) > MAX_YAML_DEPTH:
        raise ValueError(f"it nests its mappings and lists more than {MAX_YAML_DEPTH} levels deep, deeper than epo "
                         "reads (a run's config.yaml nests 4)")
    values = _expanded_values(root, {}, set()) if root is not None else 0
    if values > MAX_YAML_VALUES:
        raise ValueError(f"its aliases (*name) expand it to {values} values, more than the {MAX_YAML_VALUES} "
                         "epo reads (an alias bomb; a run's config.yaml holds about a thousand)")
    return OmegaConf.load(io.StringIO(text))


# ---- trainer_state.json --------------------------------------------------------------------------------------

def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _trainer_problem(trainer: Any) -> str | None:
    """What is wrong with the `trainer` counters of a trainer_state.json, or None."""
    if not isinstance(trainer, Mapping):
        return "`trainer` is not an object"
    known = {"step", "consecutive_skips", "best_value", "best_step", "logger_ids", "collapse_signals"}
    if set(trainer) - known:
        return f"`trainer` has unknown entries {sorted(set(trainer) - known)}"
    step = trainer.get("step")
    if not _is_int(step) or step < 0:
        return f"`trainer.step` is {step!r}, not a whole number >= 0"
    if not _is_int(trainer.get("consecutive_skips", 0)) or trainer.get("consecutive_skips", 0) < 0:
        return f"`trainer.consecutive_skips` is {trainer.get('consecutive_skips')!r}, not a whole number >= 0"
    best_value, best_step = trainer.get("best_value"), trainer.get("best_step")
    if best_value is not None and (not isinstance(best_value, (int, float)) or isinstance(best_value, bool)
                                   or not math.isfinite(best_value)):
        return f"`trainer.best_value` is {best_value!r}, not a finite number or null"
    if best_step is not None and (not _is_int(best_step) or not 0 < best_step <= step):
        return f"`trainer.best_step` is {best_step!r}, not a step between 1 and trainer.step ({step})"
    ids = trainer.get("logger_ids", {})
    if not isinstance(ids, Mapping) or not all(isinstance(k, str) and isinstance(v, str) for k, v in ids.items()):
        return "`trainer.logger_ids` is not an object of strings"
    signals = trainer.get("collapse_signals", [])
    if not isinstance(signals, list) or not all(isinstance(s, str) for s in signals):
        return "`trainer.collapse_signals` is not a list of strings"
    return None


def _written_by_problem(record: Any) -> str | None:
    """What is wrong with the `written_by` entry of a trainer_state.json (epo_cli/training/checkpoint.py), or None."""
    if not isinstance(record, Mapping) or set(record) != {"algo", "critic", "model"}:
        return "`written_by` is not an object of algo, critic and model"
    if not isinstance(record["algo"], str) or not isinstance(record["critic"], bool):
        return "`written_by.algo` is not a string or `written_by.critic` not true/false"
    model = record["model"]
    if not isinstance(model, Mapping) or not all(isinstance(k, str) and isinstance(v, (int, str, bool))
                                                 for k, v in model.items()):
        return "`written_by.model` is not an object of numbers and strings"
    return None


def _folder_step(folder: Path) -> int | None:
    name = folder.name
    return int(name[5:]) if name.startswith("step_") and name[5:].isdigit() else None


def read_trainer_state(folder: Path) -> dict[str, Any]:
    """trainer_state.json of a checkpoint folder, checked whole (see the module docstring); UserError naming
    the file and the problem. Returns the payload without its `format` entry."""
    path = Path(folder) / "trainer_state.json"
    try:  # bounded: a regular file inside the checkpoint, at most its cap, nested at most MAX_JSON_DEPTH
        payload = read_json(path, "trainer state", within=Path(folder))
    except (OSError, ReceivedFileError) as err:
        why = err.reason if isinstance(err, ReceivedFileError) else \
            f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"
        raise UserError(f"'{path}' is unreadable ({why}); the "
                        "checkpoint cannot be resumed. Resume from another checkpoint of the run "
                        "(trainer.resume=<run>/checkpoints/step_N); nothing was modified.") from None
    if not isinstance(payload, dict):
        raise UserError(f"'{path}' is not a JSON object (it holds a {type(payload).__name__}); the checkpoint "
                        "cannot be resumed. Resume from another checkpoint of the run "
                        "(trainer.resume=<run>/checkpoints/step_N); nothing was modified.")
    found = payload.get("format")
    if found != CHECKPOINT_FORMAT:
        raise UserError(
            f"Checkpoint '{folder}' has format {found or 'none (written before epo-checkpoint/2)'}, and this "
            f"epo reads {CHECKPOINT_FORMAT}: older checkpoints kept pickled RNG states, which epo no longer "
            "unpickles. Start a new run from its weights instead: model.path=<run>/final (or evaluate it with "
            "`epo eval run=<run> checkpoint=<step_N>`, which reads weights only)."
        )
    problem = _trainer_problem(payload.get("trainer"))
    if problem is None:
        step = payload["trainer"]["step"]
        named = _folder_step(Path(folder))
        marker = Path(folder) / "COMPLETE"
        marked = _marker_text(marker)
        if named is not None and step != named:
            problem = f"`trainer.step` is {step} but the folder is {Path(folder).name}"
        elif marked.isdigit() and int(marked) != step:
            problem = f"`trainer.step` is {step} but its COMPLETE marker says step {marked}"
    for part in ("entropy_history", "monitor", "entropy_schedule", "curriculum"):
        if problem is None and not isinstance(payload.get(part, {}), Mapping):
            problem = f"`{part}` is not an object"
    if problem is None and ("entropy_history" not in payload or "monitor" not in payload):
        problem = "`entropy_history` or `monitor` is missing"
    if problem is None and "written_by" in payload:  # absent in checkpoints saved before it was recorded
        problem = _written_by_problem(payload["written_by"])
    if problem is not None:
        raise UserError(f"'{path}' does not describe this checkpoint: {problem}. It was damaged or edited; "
                        "resume from another checkpoint of the run (trainer.resume=<run>/checkpoints/step_N). "
                        "Nothing was loaded or modified.")
    payload.pop("format")
    return payload


def _marker_text(marker: Path) -> str:
    """A COMPLETE marker's text ("" when missing or not a small regular file: then it says nothing)."""
    try:
        return read_text(marker, "pointer", within=marker.parent, errors="replace").strip()
    except (OSError, ReceivedFileError):
        return ""


@contextlib.contextmanager
def refusing_damaged(folder: Path) -> Iterator[None]:
    """Restoring the parts' states from a checked payload: an entry of the wrong shape deep inside one (that
    the checks above do not know) is still one message naming the file, not a traceback."""
    try:
        yield
    except (KeyError, TypeError, ValueError, AttributeError, IndexError) as err:
        raise UserError(f"'{Path(folder) / 'trainer_state.json'}' holds a state this epo cannot restore "
                        f"({type(err).__name__}: {str(err)[:200]}). Resume from another checkpoint of the run "
                        "(trainer.resume=<run>/checkpoints/step_N); nothing was modified.") from None


# ---- resuming ------------------------------------------------------------------------------------------------

def check_resume_step(step: int, total_steps: int, folder: Path) -> None:
    """A checkpoint at or beyond trainer.total_steps leaves nothing to train: say so instead of 'finished'."""
    if step >= total_steps:
        raise ConfigError(f"The checkpoint {folder} is at step {step} and trainer.total_steps={total_steps}: nothing "
                          f"is left to train. To continue, pass a larger trainer.total_steps (e.g. "
                          f"trainer.total_steps={step + max(1, total_steps)}); to use the trained policy, "
                          "evaluate the run (`epo eval run=<run>`).")


# ---- a model folder (model.path=, a run's final/) -------------------------------------------------------------

def _json_object(path: Path, kind: str = "model config", within: Path | None = None) -> dict[str, Any]:
    """A JSON file that must hold an object, read as bounded data (epo_cli/rundir/received.py); ValueError
    saying what it holds instead."""
    try:
        data = read_json(path, kind, within=within if within is not None else path.parent)
    except ReceivedFileError as err:
        raise ValueError(err.reason) from None
    except OSError as err:
        raise ValueError(f"is not readable JSON ({type(err).__name__}: {str(err).splitlines()[0][:200]})") from None
    if not isinstance(data, dict):
        raise ValueError(f"holds a JSON {type(data).__name__}, not an object")
    return data


#: bytes per element of each safetensors dtype (the format's own list)
SAFETENSORS_DTYPES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "F8_E8M0": 1, "I16": 2, "U16": 2,
                      "F16": 2, "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8, "C64": 8}


def _unique_names(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """json object_pairs_hook: a name given twice is a lie of the header (which tensor is it?)."""
    names = [k for k, _ in pairs]
    twice = sorted({k for k in names if names.count(k) > 1})
    if twice:
        raise ValueError(f"names {twice[0]!r} twice")
    return dict(pairs)


def safetensors_shapes(path: Path, within: Path | None = None) -> dict[str, list[int]]:
    """The tensors' shapes in a safetensors file's header (an 8-byte length, then JSON), read without its
    data, bounded (a regular file inside `within`, a header of at most 100 MB nested at most MAX_JSON_DEPTH),
    and checked as the safetensors library does before it maps anything: each entry's dtype known, its shape
    whole numbers >= 0, its data offsets exactly its shape's bytes, the tensors' data back to back from the
    header's end to the file's end (no gap, overlap or trailing bytes), no name twice. ValueError naming
    the first lie."""
    try:
        head, size = read_prefix(path, "safetensors header", 8, within=within or path.parent)
    except ReceivedFileError as err:
        raise ValueError(err.reason) from None
    if size == 0:
        raise ValueError("is empty (0 bytes)")
    if len(head) < 8:
        raise ValueError(f"is {size} bytes long, too short for a safetensors header")
    (length,) = struct.unpack("<Q", head)
    if length > size - 8:
        raise ValueError(f"announces a {length}-byte header in a {size}-byte file (it was cut short)")
    if length > LIMITS["safetensors header"]:
        raise ValueError(f"announces a {length}-byte header, more than the {LIMITS['safetensors header']} bytes "
                         "safetensors allows")
    try:
        raw, _ = read_prefix(path, "safetensors header", 8 + length, within=within or path.parent)
        header = loads(raw[8:], object_pairs_hook=_unique_names)
    except ReceivedFileError as err:
        raise ValueError(err.reason) from None
    except UnicodeDecodeError:
        raise ValueError("has a header that is not JSON (not a safetensors file, or damaged)") from None
    except ValueError as err:  # json.JSONDecodeError, a name twice, nesting beyond the cap
        if isinstance(err, json.JSONDecodeError):
            raise ValueError("has a header that is not JSON (not a safetensors file, or damaged)") from None
        raise ValueError(f"has a header that {err}") from None
    if not isinstance(header, dict):
        raise ValueError("has a header that is not a JSON object (not a safetensors file)")
    shapes, spans = {}, []
    for name, entry in header.items():
        if name == "__metadata__":
            if not (isinstance(entry, dict) and all(isinstance(v, str) for v in entry.values())):
                raise ValueError("has a `__metadata__` that is not an object of strings")
            continue
        offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
        shape = entry.get("shape") if isinstance(entry, dict) else None
        dtype = entry.get("dtype") if isinstance(entry, dict) else None
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_int(o) for o in offsets)
                and isinstance(shape, list) and all(_is_int(d) for d in shape)):
            raise ValueError(f"has a header entry for {name!r} without a shape and data offsets")
        if dtype not in SAFETENSORS_DTYPES:
            raise ValueError(f"gives {name!r} the dtype {dtype!r}, which safetensors does not have")
        if any(d < 0 for d in shape):
            raise ValueError(f"gives {name!r} the shape {shape}, with a negative size")
        begin, end = offsets
        need = math.prod(shape) * SAFETENSORS_DTYPES[dtype]
        if not 0 <= begin <= end or end - begin != need:
            raise ValueError(f"gives {name!r} the data offsets {offsets}, but its shape {shape} of {dtype} needs "
                             f"{need} bytes")
        shapes[name] = shape
        spans.append((begin, end, name))
    at = 0
    for begin, end, name in sorted(spans):
        if begin != at:
            raise ValueError(f"places {name!r} at byte {begin} of the data, where {at} was expected (the "
                             "tensors' data overlap or leave a gap)")
        at = end
    if 8 + length + at > size:
        raise ValueError(f"holds {size} bytes but its header describes {8 + length + at} (it was cut short)")
    if 8 + length + at < size:
        raise ValueError(f"holds {size} bytes but its header describes {8 + length + at} (bytes follow the "
                         "last tensor)")
    return shapes


#: what to do about a damaged model folder
COPY_AGAIN = ("copy it again from where it came from, or pass another model (model.path=DIR; for a run's final/, "
              "`epo eval run=<run> checkpoint=step_N` evaluates one of its checkpoints)")


class _FolderProblem(Exception):
    """A file of a model folder and what is wrong with it (check_model_folder turns it into one UserError)."""

    def __init__(self, path: Path, what: str, fix: str = COPY_AGAIN) -> None:
        super().__init__(f"'{path}' {what}")
        self.fix = fix


def _weight_files(folder: Path, within: Path) -> list[Path]:
    """The safetensors files of a model folder: model.safetensors, or those its index lists (each a plain
    file name inside the folder)."""
    index = folder / "model.safetensors.index.json"
    if os.path.lexists(index):
        weight_map = _json_object(index, within=within).get("weight_map")
        if not isinstance(weight_map, dict):
            raise _FolderProblem(index, "has no `weight_map` object")
        names = sorted({str(v) for v in weight_map.values()})
        odd = next((n for n in names if Path(n).name != n or n in ("", ".", "..")), None)
        if odd is not None:
            raise _FolderProblem(index, f"names the weights file {odd!r}, which is not a file name in the folder")
        return [folder / name for name in names]
    return [folder / "model.safetensors"] if os.path.lexists(folder / "model.safetensors") else []


#: the tokenizer's and the model's other files transformers reads from a folder when they are there (JSON ones
#: are parsed here too); each must be a regular file, or transformers would skip it and use another tokenizer
TOKENIZER_JSON = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                  "vocab.json", "generation_config.json", "chat_template.json", "preprocessor_config.json")
TOKENIZER_OTHER = ("merges.txt", "vocab.txt", "tokenizer.model", "spiece.model", "sentencepiece.bpe.model",
                   "chat_template.jinja")
#: weights transformers reads when the folder has no safetensors (through the restricted unpickler)
PICKLED_WEIGHTS = ("pytorch_model.bin", "pytorch_model.bin.index.json")
#: config.json's counts that size the model: whole numbers >= 1 where present (0 heads divides by zero)
CONFIG_COUNTS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                 "num_key_value_heads", "max_position_embeddings", "head_dim")
#: a tokenizer's special tokens: a string, an AddedToken object ({"content": ...}) or null
SPECIAL_TOKENS = ("eos_token", "bos_token", "pad_token", "unk_token")


def _config_problem(config: dict[str, Any]) -> str | None:
    """What in config.json cannot build a model (a count of 0 would divide by zero deep in transformers)."""
    for key in CONFIG_COUNTS:
        value = config.get(key)
        if key in config and not (value is None and key == "head_dim") and not (_is_int(value) and value >= 1):
            return f"gives {key}={value!r}, not a whole number >= 1"
    heads, kv = config.get("num_attention_heads"), config.get("num_key_value_heads")
    if _is_int(heads) and _is_int(kv) and heads % kv:
        return f"gives num_attention_heads={heads}, not a multiple of num_key_value_heads={kv}"
    hidden = config.get("hidden_size")
    if _is_int(heads) and _is_int(hidden) and config.get("head_dim") is None and hidden % heads:
        return f"gives hidden_size={hidden}, not a multiple of num_attention_heads={heads} (and no head_dim)"
    for key in ("hidden_act", "hidden_activation"):
        if key in config and not isinstance(config[key], str):
            return f"gives {key}={config[key]!r}, not the name of an activation"
    for key in ("rope_scaling", "rope_parameters"):
        value = config.get(key)
        if value is not None and not isinstance(value, dict):
            return f"gives {key}={value!r}, not an object or null"
    return None


def check_model_path(model_cfg: Any) -> None:
    """`model.path=<local folder>` checked (check_model_folder) before `epo train` writes a run directory; a
    path that is a file is one message saying so."""
    path = Path(str(model_cfg.path)).expanduser() if model_cfg.path else None
    if path is not None and path.exists() and not path.is_dir():
        raise UserError(f"model.path='{model_cfg.path}' is a file, not a model folder. Pass the folder written by "
                        "save_pretrained (the one holding config.json), e.g. <run>/final, or a hub id.")
    if path is not None and path.is_dir():
        check_model_folder(path, bool(model_cfg.trust_remote_code))


def check_model_folder(folder: Path, trust_remote_code: bool, weights: bool = True) -> None:
    """A model folder is checked before anything loads from it (or a run directory is written for it), every
    file read as bounded data (epo_cli/rundir/received.py: regular files, symlinks only inside the folder or,
    for a hub cache snapshot, its repository folder): config.json and the tokenizer files must be JSON objects
    of the shape transformers reads (tokenizer.json with its `model` and `added_tokens`, special tokens
    strings), every tokenizer file there a regular file (else transformers would skip it and use another
    tokenizer), config.json's counts whole numbers >= 1, no auto_map (the folder's own code) unless
    model.trust_remote_code=true is on this command line, every safetensors header true to its file
    (safetensors_shapes), and the embedding in the weights the shape config.json gives (vocab_size x
    hidden_size). One UserError naming the file and what is wrong; nothing is loaded or written.
    `weights=False`: the tokenizer's files and the folder's code only (a scripted policy reads the tokenizer
    alone). Hub ids are left to transformers; the weights' names are checked against the model's own when it
    loads (epo_cli/models/loading.py), pytorch_model.bin through the restricted unpickler."""
    try:
        _check_model_folder(Path(folder), trust_remote_code, weights)
    except _FolderProblem as err:
        raise UserError(f"{err}. Nothing was loaded from the model folder '{folder}' or written; {err.fix}.") from None


def _check_model_folder(folder: Path, trust_remote_code: bool, weights: bool) -> None:
    """Each file of `folder` checked as data (_FolderProblem: the first that is not what it claims)."""
    root = model_folder_root(folder)
    config = _read(folder / "config.json", "model config", root)
    problem = _config_problem(config)
    if problem is not None:
        raise _FolderProblem(folder / "config.json", problem)
    _check_tokenizer_files(folder, root, config, trust_remote_code)
    if weights:
        _check_weight_files(folder, root, config)


def _read(path: Path, kind: str, root: Path) -> dict[str, Any]:
    """A JSON object of the folder (_json_object), or _FolderProblem naming it."""
    try:
        return _json_object(path, kind, within=root)
    except ValueError as err:
        raise _FolderProblem(path, str(err)) from None


def _regular(path: Path, kind: str, root: Path) -> None:
    """A file of the folder that must be a regular file (check_regular), or _FolderProblem naming it."""
    try:
        check_regular(path, kind, within=root)
    except ReceivedFileError as err:
        raise _FolderProblem(path, err.reason) from None


def _check_tokenizer_files(folder: Path, root: Path, config: dict[str, Any], trust_remote_code: bool) -> None:
    """The tokenizer's files: JSON objects where JSON, regular files otherwise; no model code (auto_map)
    unless the command line trusts it; special tokens that are strings; tokenizer.json's parts present."""
    present = [name for name in TOKENIZER_JSON if os.path.lexists(folder / name)]
    files = {name: _read(folder / name, "tokenizer" if name == "tokenizer.json" else "model config", root)
             for name in present}
    for name in TOKENIZER_OTHER:
        if os.path.lexists(folder / name):
            _regular(folder / name, "tokenizer", root)
    for name in ("config.json", "tokenizer_config.json"):
        data = config if name == "config.json" else files.get(name, {})
        if "auto_map" in data and not trust_remote_code:
            raise _FolderProblem(folder / name, "has an auto_map: the folder holds its own model code, which "
                                 "runs when it loads, and epo runs a model folder's code only when this command "
                                 "line says model.trust_remote_code=true (a saved config cannot)",
                                 "pass model.trust_remote_code=true if you trust that code, or use another model")
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        for key in SPECIAL_TOKENS:
            value = files.get(name, {}).get(key)
            if not (value is None or isinstance(value, str)
                    or (isinstance(value, dict) and isinstance(value.get("content"), str))):
                raise _FolderProblem(folder / name, f"gives {key}={str(value)[:80]!r}, not a token (a string)")
    if "tokenizer.json" in files:
        tokenizer = files["tokenizer.json"]
        for key, kind in (("model", dict), ("added_tokens", list)):
            if not isinstance(tokenizer.get(key), kind):
                state = "has no" if key not in tokenizer else "has a damaged"
                noun = "object" if kind is dict else "list"
                raise _FolderProblem(folder / "tokenizer.json", f"{state} `{key}` {noun} (transformers needs it: "
                                     "the file is damaged or cut down)")


def _check_weight_files(folder: Path, root: Path, config: dict[str, Any]) -> None:
    """The weights: every safetensors file the index lists present, each header readable and bounded, the
    embeddings' shape agreeing with config.json; pickled weights regular files (read later, restricted)."""
    shapes: dict[str, list[int]] = {}
    try:
        weight_files = _weight_files(folder, root)
    except ValueError as err:
        raise _FolderProblem(folder / "model.safetensors.index.json", str(err)) from None
    for path in weight_files:
        if not os.path.lexists(path):
            raise _FolderProblem(path, "is missing (model.safetensors.index.json lists it)")
        try:
            shapes.update(safetensors_shapes(path, within=root))
        except ValueError as err:
            raise _FolderProblem(path, str(err)) from None
    if not weight_files:
        for name in PICKLED_WEIGHTS:
            if os.path.lexists(folder / name):
                _regular(folder / name, "safetensors header" if name.endswith(".json") else "weights", root)
    embedding = next((name for name in shapes if name.endswith("embed_tokens.weight")), None)
    vocab, hidden = config.get("vocab_size"), config.get("hidden_size")
    if embedding is not None and isinstance(vocab, int) and isinstance(hidden, int) \
            and len(shapes[embedding]) == 2 and shapes[embedding] != [vocab, hidden]:
        rows, cols = shapes[embedding]
        what = [f"vocab_size={vocab} but the weights hold {rows} token embeddings"] if rows != vocab else []
        what += [f"hidden_size={hidden} but the embeddings have {cols} values each"] if cols != hidden else []
        raise _FolderProblem(folder / "config.json", f"disagrees with the weights ({embedding} is {rows} x {cols}): "
                             + "; ".join(what))
