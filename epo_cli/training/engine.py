"""DeepSpeed: process group, engine configs derived from the algorithm's batch sizes, and helpers.

Every run, a single CPU process included, trains through a DeepSpeed engine (ZeRO stage from
`deepspeed=zero0..zero3`), so a laptop run exercises the code path of an 8-GPU job. Gradient
accumulation is owned by the training loop (`managed_gradient_accumulation: false`): a mini-batch of
turn-samples may need a different number of micro-batches each iteration, and one `engine.step()`
closes it.
"""

from __future__ import annotations

import copy
import datetime
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as torch_dist
from torch import nn

from epo_cli.runtime.deepspeed_config import PORT_ATTEMPTS, free_port, port_taken
from epo_cli.runtime.device import pick_device


@dataclass
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


#: set when this process picked its own MASTER_PORT (a world of one), so a taken port may be replaced
OWN_PORT_ENV = "EPO_OWN_MASTER_PORT"


def init_distributed(trainer_device: str, timeout_s: float) -> DistInfo:
    """Join (or, for a plain single process, create) the process group on trainer.device=`trainer_device`,
    its collectives timing out after launcher.timeout_s=`timeout_s`. A world of one picks a free port for
    itself; when another process takes it before the store listens on it, it picks another (PORT_ATTEMPTS)."""
    import deepspeed

    if "RANK" not in os.environ:  # not started by a launcher: a world of one
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(free_port()), **{OWN_PORT_ENV: "1"})
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = pick_device(trainer_device, local_rank)
    if not torch_dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        for attempt in range(1, PORT_ATTEMPTS + 1):
            try:
                deepspeed.init_distributed(dist_backend=backend, verbose=False,
                                           timeout=datetime.timedelta(seconds=timeout_s))
                break
            except RuntimeError as err:  # torch's DistNetworkError names EADDRINUSE
                own_port = os.environ.get(OWN_PORT_ENV) == "1" and os.environ.get("WORLD_SIZE") == "1"
                if not own_port or not port_taken(str(err)) or attempt == PORT_ATTEMPTS:
                    raise
                os.environ["MASTER_PORT"] = str(free_port())
    return DistInfo(torch_dist.get_rank(), torch_dist.get_world_size(), local_rank, device)


# ---- collectives (no-ops in a world of one) ------------------------------------------------------------

def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    if torch_dist.is_initialized() and torch_dist.get_world_size() > 1:
        t = t.clone()
        torch_dist.all_reduce(t, op=torch_dist.ReduceOp.SUM)
    return t


def all_reduce_max(t: torch.Tensor) -> torch.Tensor:
    if torch_dist.is_initialized() and torch_dist.get_world_size() > 1:
        t = t.clone()
        torch_dist.all_reduce(t, op=torch_dist.ReduceOp.MAX)
    return t


def all_gather_objects(obj: Any) -> list[Any]:
    if torch_dist.is_initialized() and torch_dist.get_world_size() > 1:
        out: list[Any] = [None] * torch_dist.get_world_size()
        torch_dist.all_gather_object(out, obj)
        return out
    return [obj]


def barrier() -> None:
    if torch_dist.is_initialized() and torch_dist.get_world_size() > 1:
        torch_dist.barrier()


# ---- optimizer ------------------------------------------------------------------------------------------

class GuardedAdamW(torch.optim.AdamW):
    """AdamW that refuses to apply a non-finite gradient (on any rank) and records the gradient norm.

    DeepSpeed calls `step()` with the gradients already reduced across ranks (ZeRO: this rank's
    partition), so the finiteness check all-reduces one flag and every rank skips together.
    With ZeRO stage 0, DeepSpeed does not report the gradient norm, so this optimizer clips and
    measures it (`clip_norm`); with ZeRO stages 1-3 DeepSpeed clips and reports it.
    """

    def __init__(self, params: Any, clip_norm: float | None = None, **kwargs: Any) -> None:
        super().__init__(params, **kwargs)
        self.clip_norm = clip_norm
        self.last_skipped = False
        self.last_grad_norm: float | None = None

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        grads = [p.grad for group in self.param_groups for p in group["params"] if p.grad is not None]
        finite = torch.tensor([float(all(torch.isfinite(g).all() for g in grads))])
        finite = finite.to(grads[0].device) if grads else finite
        if torch_dist.is_initialized() and torch_dist.get_world_size() > 1:
            torch_dist.all_reduce(finite, op=torch_dist.ReduceOp.MIN)
        self.last_skipped = bool(finite.item() < 1)
        if self.last_skipped:
            for g in grads:
                g.zero_()
            return None
        if self.clip_norm is not None and grads:
            norm = torch.nn.utils.clip_grad_norm_(
                [p for group in self.param_groups for p in group["params"] if p.grad is not None],
                self.clip_norm if self.clip_norm > 0 else float("inf"))
            self.last_grad_norm = float(norm)
        return super().step(closure)


def set_lr(engine: Any, lr: float) -> None:
    """Set the learning rate of every parameter group. The schedule is a function of the trainer step
    (warmup_cosine in epo_cli.algos.schedules): RL iterations take a varying number of optimizer steps."""
    for group in engine.optimizer.param_groups:
        group["lr"] = lr


# ---- engines (their JSON config: epo_cli/runtime/deepspeed_config.py) ---------------------------------------

def zero_bucket_sizes(model: nn.Module, stage: int) -> dict[str, int]:
    """ZeRO bucket sizes scaled to the model (the recipe of transformers' "auto" DeepSpeed values).

    DeepSpeed's defaults are 5e8-element reduce buckets: ZeRO-2 allocates one (2 GB in fp32) per
    micro-batch, which took ~10 s per update on a CPU and wastes memory on small models. ZeRO-3's
    default persistence threshold (1e5 elements) would also leave every parameter of a small model
    unpartitioned.
    """
    if stage == 0:
        return {}
    hidden = getattr(getattr(model, "config", None), "hidden_size", None)
    if not hidden:
        return {}
    bucket = int(min(5e8, max(hidden * hidden, 2**16)))  # a floor of 256 KB: tiny models, few reductions
    bucket -= bucket % 1024  # DeepSpeed wants bucket sizes aligned to its communication alignment
    sizes = {"reduce_bucket_size": bucket, "allgather_bucket_size": bucket}
    if stage == 3:
        sizes.update(stage3_prefetch_bucket_size=int(0.9 * hidden * hidden),
                     stage3_param_persistence_threshold=10 * hidden)
        sizes.pop("allgather_bucket_size")
    return sizes


def enable_gradient_checkpointing(model: nn.Module) -> None:
    """Recompute activations in the backward pass (HF gradient checkpointing; the critic: its backbone)."""
    target = model if hasattr(model, "gradient_checkpointing_enable") else getattr(model, "backbone", None)
    if target is not None and hasattr(target, "gradient_checkpointing_enable"):
        target.gradient_checkpointing_enable()
        if getattr(target, "config", None) is not None:
            target.config.use_cache = False


@dataclass(frozen=True)
class EngineSettings:
    """What build_engine reads, fixed for the run (training/settings.py cuts it from the run config)."""

    deepspeed: dict[str, Any]  # DeepSpeed's JSON config (deepspeed_config.py), without the model's bucket sizes
    zero_stage: int
    activation_checkpointing: bool  # deepspeed.activation_checkpointing (as HF gradient checkpointing)
    grad_clip: float  # algo.grad_clip: GuardedAdamW clips under ZeRO-0 (DeepSpeed itself under ZeRO 1-3)


def build_engine(model: nn.Module, settings: EngineSettings, lr: float, weight_decay: float = 0.0):
    """Wrap `model` in a DeepSpeed engine with GuardedAdamW (the loop sets the learning rate per step)."""
    import deepspeed

    config = copy.deepcopy(settings.deepspeed)  # the settings stay as built; DeepSpeed may keep this dict
    config["zero_optimization"].update(zero_bucket_sizes(model, settings.zero_stage))
    if settings.activation_checkpointing:
        enable_gradient_checkpointing(model)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = GuardedAdamW(params, lr=lr, weight_decay=weight_decay, betas=(0.9, 0.999),
                             clip_norm=settings.grad_clip if settings.zero_stage == 0 else None)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config,
                                           dist_init_required=False)
    return engine


def grad_norm(engine: Any) -> float | None:
    norm = engine.get_global_grad_norm()
    if norm is None:
        norm = getattr(engine.optimizer, "last_grad_norm", None) or getattr(
            getattr(engine.optimizer, "optimizer", None), "last_grad_norm", None)
    return None if norm is None else float(norm)


def step_was_skipped(engine: Any) -> bool:
    opt = engine.optimizer
    inner = getattr(opt, "optimizer", opt)
    return bool(getattr(opt, "last_skipped", False) or getattr(inner, "last_skipped", False))


def inference_copy(model: nn.Module, zero_stage: int) -> nn.Module | None:
    """Under ZeRO-3: a full, frozen copy of `model` for generation (RolloutModule). It must be made
    before deepspeed.initialize: afterwards the module holds empty partitions and DeepSpeed's hooks."""
    if zero_stage != 3:
        return None
    twin = copy.deepcopy(model).eval()
    for p in twin.parameters():
        p.requires_grad_(False)
    return twin


class RolloutModule:
    """The module that generates and scores rollouts on this rank.

    ZeRO 0-2 keep full parameters on every rank: the engine's own module is used. Under ZeRO-3 the
    parameters are partitioned, and a forward would need all ranks in lock-step for every decoded token;
    instead each rank keeps an inference copy whose weights are gathered once after each update.
    """

    def __init__(self, engine: Any, template: nn.Module | None, zero_stage: int) -> None:
        """`template`: the inference copy from `inference_copy` (made before deepspeed.initialize)."""
        self.engine = engine
        self.copy = template if zero_stage == 3 else None
        if zero_stage == 3 and template is None:
            raise ValueError("ZeRO-3 needs the inference copy made by inference_copy() before initialize")

    def refresh(self) -> None:
        """Gather the trained weights into the inference copy (collective under ZeRO-3)."""
        if self.copy is None:
            return
        import deepspeed

        params = dict(self.engine.module.named_parameters())
        target = dict(self.copy.named_parameters())
        with deepspeed.zero.GatheredParameters(list(params.values()), modifier_rank=None):
            for name, p in params.items():
                target[name].data.copy_(p.data.to(target[name].dtype))

    @property
    def module(self) -> nn.Module:
        return self.copy if self.copy is not None else self.engine.module
