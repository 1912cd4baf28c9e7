"""How the model is spread over the ranks: DDP or FSDP2 (``trainer.strategy``).

The one place that knows the difference. The training loop asks a :class:`Strategy` for
the model to call, the no-sync context of gradient accumulation, gradient clipping, the
loss scaler, the optimizer and the state dicts of snapshots; it never branches on the
strategy itself.

* ``ddp``: every rank holds the whole model, its gradients and AdamW's state (16 bytes per
  parameter in fp32); gradients are all-reduced. Snapshots are one file written by rank 0.
* ``fsdp``: FSDP2 (``fully_shard``): each transformer block is its own unit, then the root
  (embeddings, final LayerNorm, the tied head). Parameters, gradients and optimizer state
  are sharded over the ranks (about 16/N bytes per parameter); a block's parameters are
  all-gathered just for its forward and backward. Snapshots are sharded
  (sharded_snapshot.py): every rank writes its shard. With one process the mesh has one
  rank: nothing is sharded, but the snapshots have the same layout, so a run can change
  its world size (DCP reshards) in either direction.
"""
from __future__ import annotations

import contextlib
import ctypes
import hashlib
from typing import Any, ContextManager, Optional

import torch
import torch.distributed as torch_dist

from mingpt_ddp.config import OptimizerConfig, TrainerConfig
from mingpt_ddp.distributed import DistEnv
from mingpt_ddp.errors import ConfigError
from mingpt_ddp.model import GPT
from mingpt_ddp.precision import PrecisionPlan

STRATEGIES = ("ddp", "fsdp")


def strategy_name(cfg: TrainerConfig) -> str:
    value = cfg.strategy
    return getattr(value, "value", value)


def _tensor_bytes(t: torch.Tensor) -> memoryview:
    t = t.detach().cpu().contiguous()
    return ctypes.string_at(t.data_ptr(), t.numel() * t.element_size())


class Strategy:
    """DDP: a full replica per rank (also the plain model when there is one process)."""

    name = "ddp"
    sharded_snapshots = False  # snapshots: one file by rank 0 (snapshot.py)
    # Must every rank run each forward pass (FSDP gathers parameters in it)? DDP's model
    # alone runs on one rank (rank 0's sample preview).
    collective_forward = False

    def __init__(self, cfg: TrainerConfig, dist: DistEnv, model: GPT, precision: PrecisionPlan):
        self.cfg, self.dist, self.model, self.precision = cfg, dist, model, precision
        self.compiled = self._use_compile()
        self.forward_model = torch.compile(model) if self.compiled else model
        self.train_model = self._wrap()

    def _use_compile(self) -> bool:
        return self.cfg.compile if self.cfg.compile is not None else self.dist.device.type == "cuda"

    def _wrap(self) -> torch.nn.Module:
        if not self.dist.is_distributed:
            return self.forward_model
        # Inside DDP's forward, torch.compile splits the graph at DDP's bucket boundaries
        # (DDPOptimizer), so the all-reduces still overlap the backward pass.
        from torch.nn.parallel import DistributedDataParallel as DDP

        return DDP(
            self.forward_model,
            device_ids=[self.dist.device.index] if self.dist.device.type == "cuda" else None,
            gradient_as_bucket_view=True,  # gradients are views into the all-reduce buckets: no copies
            bucket_cap_mb=self.cfg.ddp_bucket_cap_mb,
            static_graph=self.cfg.ddp_static_graph,
        )

    # ---- the step ---------------------------------------------------------------------------
    def no_sync(self, last: bool) -> ContextManager:
        """Gradients are reduced once per optimizer step, in the last micro-step's backward."""
        if last or not self.dist.is_distributed:
            return contextlib.nullcontext()
        return self.train_model.no_sync()

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Clip to `max_norm`; returns the total norm over all parameters (the tied head once)."""
        return torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)

    def grad_scaler(self) -> torch.amp.GradScaler:
        return self.precision.grad_scaler()

    def make_optimizer(self, cfg: OptimizerConfig) -> torch.optim.Optimizer:
        muon = getattr(cfg.name, "value", cfg.name) == "muon"
        # Muon's orthogonalisation in the precision the run computes in: bf16 where that is fast.
        return self.model.configure_optimizer(cfg.lr, cfg.weight_decay, tuple(cfg.betas), self.dist.device.type,
                                              muon_lr=cfg.muon_lr if muon else None,
                                              muon_momentum=cfg.muon_momentum, ns_dtype=self.precision.dtype)

    def check_accumulation(self, accum_steps: int, configured: int) -> None:
        """DDP's static_graph and no_sync (gradient accumulation) do not mix: DDP's reducer
        fails with an internal assert on the first accumulated step. Refused before training,
        also when an elastic resume turns accumulation on by itself."""
        if self.cfg.ddp_static_graph and self.dist.is_distributed and accum_steps > 1:
            raise ConfigError(
                f"trainer.ddp_static_graph=true does not work with gradient accumulation ({accum_steps} "
                f"micro-batches per step on {self.dist.world_size} processes"
                + ("" if accum_steps == configured else ", chosen to keep the snapshot's global batch on this world size")
                + "): set trainer.ddp_static_graph=false"
            )

    # ---- state ----------------------------------------------------------------------------
    def state_dicts(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """{"model": ..., "optimizer": ...} for a snapshot (the full state, from this rank)."""
        return {"model": self.model.state_dict(), "optimizer": optimizer.state_dict()}

    def load_state_dicts(self, optimizer: torch.optim.Optimizer, snapshot: dict[str, Any]) -> None:
        self.model.load_state_dict(snapshot["model"])
        optimizer.load_state_dict(snapshot["optimizer"])

    def fingerprint(self) -> str:
        """sha256 of the parameters and buffers (of the whole model, also when sharded)."""
        h = hashlib.sha256()
        for name, p in sorted(self.model.state_dict().items()):
            h.update(name.encode())
            h.update(_tensor_bytes(p.full_tensor() if hasattr(p, "full_tensor") else p))
        return h.hexdigest()[:16]

    def state_bytes(self, optimizer: torch.optim.Optimizer, local: bool = True) -> dict[str, int]:
        """Bytes of parameters, gradients and optimizer state, read off the tensors: this
        rank's shards (`local`), or the whole tensors (what every DDP rank holds). A tensor
        reached twice (the tied head) is counted once."""
        seen: set[int] = set()

        def size(t: Optional[torch.Tensor]) -> int:
            if t is None or id(t) in seen:
                return 0
            seen.add(id(t))
            if local and hasattr(t, "to_local"):
                t = t.to_local()
            return t.numel() * t.element_size()

        params = list(self.model.parameters())
        return {
            "parameters": sum(size(p) for p in params),
            "gradients": sum(size(p.grad) for p in params),
            "optimizer_state": sum(size(v) for s in optimizer.state.values() for v in s.values()
                                   if isinstance(v, torch.Tensor)),
        }


class FSDPStrategy(Strategy):
    """FSDP2: parameters, gradients and AdamW state sharded over the ranks."""

    name = "fsdp"
    sharded_snapshots = True
    collective_forward = True

    def __init__(self, cfg: TrainerConfig, dist: DistEnv, model: GPT, precision: PrecisionPlan):
        if cfg.compile:
            raise ConfigError("trainer.compile=true does not work with trainer.strategy=fsdp yet: set "
                              "trainer.compile=false (or null, which leaves it off under fsdp), or use trainer.strategy=ddp")
        smallest = min(p.shape[0] for p in model.parameters())
        if smallest < dist.world_size:
            raise ConfigError(
                f"the model is too small to shard over {dist.world_size} processes: a parameter has only {smallest} "
                f"rows, so some processes would hold none of it (model.n_embd={model.cfg.n_embd}, "
                f"data.block_size={model.cfg.block_size}): use trainer.strategy=ddp (such a model fits on one "
                "device), or fewer processes"
            )
        super().__init__(cfg, dist, model, precision)

    def _use_compile(self) -> bool:
        return False  # FSDP2 with torch.compile wants each block compiled on its own: not done yet

    def _wrap(self) -> torch.nn.Module:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        if not torch_dist.is_initialized():
            # One process: a one-rank group, so the model, its state dicts and snapshots are
            # the same DTensors as on many ranks (and a snapshot moves between world sizes).
            torch_dist.init_process_group(self.dist.backend, store=torch_dist.HashStore(), rank=0, world_size=1)
        # Parameters are gathered in the compute dtype, gradients reduced in fp32 into fp32
        # master weights; autocast (precision.py) still keeps LayerNorm and softmax in fp32.
        low = self.precision.dtype if self.precision.name != "fp32" else None
        policy = MixedPrecisionPolicy(param_dtype=low, reduce_dtype=torch.float32)
        blocks = list(self.model.blocks)
        for i, block in enumerate(blocks):
            # Parameters are freed after each block's forward and gathered again for its
            # backward, except the last block's, whose backward comes at once (torchtitan's choice).
            fully_shard(block, mp_policy=policy, reshard_after_forward=i < len(blocks) - 1)
        # The root: embeddings, ln_f, and the head tied to wte; its backward comes first too.
        fully_shard(self.model, mp_policy=policy, reshard_after_forward=False)
        return self.model

    def no_sync(self, last: bool) -> ContextManager:
        """Non-last micro-steps accumulate unsharded gradients locally, without reduce-scatter."""
        self.model.set_requires_gradient_sync(last)
        return contextlib.nullcontext()

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        norm = super().clip_grad_norm_(max_norm)  # DTensor gradients: the norm is reduced over the shards
        return norm.full_tensor() if hasattr(norm, "full_tensor") else norm

    def grad_scaler(self) -> torch.amp.GradScaler:
        return ShardedGradScaler(self.dist.device.type, enabled=self.precision.uses_scaler)

    def check_accumulation(self, accum_steps: int, configured: int) -> None:
        pass  # no static graph under FSDP

    def state_dicts(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """This rank's shards (DTensors) keyed by parameter name, for torch.distributed.checkpoint."""
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_state, optim_state = get_state_dict(self.model, optimizer)
        return {"model": model_state, "optimizer": optim_state}

    def load_state_dicts(self, optimizer: torch.optim.Optimizer, snapshot: dict[str, Any]) -> None:
        """This rank's shards; or a DDP snapshot's whole tensors, of which each rank keeps its shard."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

        model_state, optim_state = snapshot["model"], snapshot["optimizer"]
        whole = not any(hasattr(v, "to_local") for v in model_state.values())
        if whole:  # torch's optimizer state dict numbers the parameters; DCP's names them
            names = {p: n for n, p in self.model.named_parameters()}
            order = [names[p] for group in optimizer.param_groups for p in group["params"]]
            optim_state = {
                "state": {order[i]: s for i, s in optim_state["state"].items()},
                "param_groups": [{**g, "params": [order[i] for i in g["params"]]} for g in optim_state["param_groups"]],
            }
        set_state_dict(self.model, optimizer, model_state_dict=model_state, optim_state_dict=optim_state,
                       options=StateDictOptions(full_state_dict=whole))


class ShardedGradScaler(torch.amp.GradScaler):
    """fp16 loss scaling over sharded gradients: each rank checks only its shards for
    inf/NaN, so the verdict is all-reduced and every rank skips (or takes) the same steps.

    torch's ShardedGradScaler does this too, but its found-inf tensor has shape [1], which
    the fused AdamW refuses (torch 2.13); this keeps GradScaler's scalar.
    """

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        super().unscale_(optimizer)
        if self.is_enabled() and torch_dist.is_initialized():
            for found_inf in self._per_optimizer_states[id(optimizer)]["found_inf_per_device"].values():
                torch_dist.all_reduce(found_inf, op=torch_dist.ReduceOp.MAX)


def make_strategy(cfg: TrainerConfig, dist: DistEnv, model: GPT, precision: PrecisionPlan) -> Strategy:
    """The strategy named by trainer.strategy, wrapping `model` (already on its device)."""
    name = strategy_name(cfg)
    if name not in STRATEGIES:
        raise ConfigError(f"trainer.strategy={name} is not known: use one of {', '.join(STRATEGIES)}")
    return (FSDPStrategy if name == "fsdp" else Strategy)(cfg, dist, model, precision)


class ShardedSaver:
    """Every rank's side of saving sharded snapshots (sharded_snapshot.py), with
    BackgroundSaver's interface: `submit` stages this rank's shards and returns while they
    are written in the background; at most one save is in flight. `run_lock` (rank 0's
    RunLock): once it is lost, rank 0 commits nothing more and every rank's save fails."""

    def __init__(self, store, run_lock: Any = None):
        self.store = store
        store.run_lock = run_lock
        self._handle = None
        self._error: Optional[str] = None
        self.last_saved: Optional[str] = None  # the newest committed snapshot directory

    def submit(self, state: dict[str, Any], step: int) -> None:
        self._finish_previous()
        sharded = {"model": state.pop("model"), "optimizer": state.pop("optimizer")}
        self._handle = self.store.save_async(step, sharded, state)  # collective: every rank stages its shards

    def _finish_previous(self) -> None:
        if self._handle is not None:
            error = self._handle.wait()
            if self._handle.committed:
                self.last_saved = self._handle.directory
            self._error = error or self._error
            self._handle = None

    @property
    def failed(self) -> bool:
        """The last save failed on this rank (the store has retried it already)."""
        if self._handle is not None and self._handle.done():
            self._finish_previous()
        return self._error is not None

    @property
    def error(self) -> Optional[str]:
        return self._error

    def wait(self) -> Optional[str]:
        """Block until the save in flight is committed; the error, the same on every rank."""
        self._finish_previous()
        return self._error

