"""How the model is spread over the ranks: DDP or FSDP2 (``trainer.strategy``).

The one place that knows the difference. The training loop asks a :class:`Strategy` for
the model to call, the no-sync context of gradient accumulation, gradient clipping, the
loss scaler, the optimizer and the state dicts of snapshots; it never branches on the
strategy itself.

* ``ddp``: every rank holds the whole model, its gradients and AdamW's state (16 bytes per
  parameter in fp32); gradients are all-reduced. Snapshots are one file written by rank 0.
  Compiled (``trainer.compile``) as one model.
* ``fsdp``: FSDP2 (``fully_shard``): each transformer block is its own unit, then the root
  (embeddings, final LayerNorm, the tied head). Parameters, gradients and optimizer state
  are sharded over the ranks (about 16/N bytes per parameter); a block's parameters are
  all-gathered just for its forward and backward. The model is built on the meta device and
  each rank fills in only its shards. Compiled block by block, and the root's embeddings
  and its head with the loss as two graphs of their own. Snapshots are sharded
  (sharded_snapshot.py): every rank writes its shard. With one process the mesh has one
  rank: nothing is sharded, but the snapshots have the same layout, so a run can change
  its world size (DCP reshards) in either direction.

Evaluation runs `eval_model`: under compile a graph of its own for eval mode and no_grad,
compiled at the first evaluation and reused by every later one.
"""
from __future__ import annotations

import contextlib
import ctypes
import hashlib
from typing import Any, ContextManager, Optional

import torch
import torch.distributed as torch_dist

from mingpt_ddp.config import OptimizerConfig, TrainerConfig, ddp_bucket_cap_mb
from mingpt_ddp.distributed import DistEnv, process_group_options
from mingpt_ddp.errors import ConfigError
from mingpt_ddp.model import GPT, GPTConfig
from mingpt_ddp.precision import PrecisionPlan

STRATEGIES = ("ddp", "fsdp")


def strategy_name(cfg: TrainerConfig) -> str:
    value = cfg.strategy
    return getattr(value, "value", value)


def build_model(cfg: TrainerConfig, model_cfg: GPTConfig,
                weights: Optional[dict[str, torch.Tensor]] = None) -> GPT:
    """The model for the Trainer, from the global generator's state (seed it first). Under
    FSDP it is built on the meta device, shapes only: each rank fills in its own shards after
    sharding (the same values as the whole model built on the CPU), so the whole model is
    never in any one device's memory. `weights` (this model's names, whole tensors on the
    CPU: model.init_from) replace the random initial values: under DDP written into the
    whole model here, under FSDP into each rank's shards where they are filled in."""
    if strategy_name(cfg) == "fsdp" or weights is not None:
        with torch.device("meta"):
            model = GPT(model_cfg)
        model.init_values = weights
        if strategy_name(cfg) != "fsdp":  # DDP: the whole model, filled in now (no random draws to overwrite)
            model.to_empty(device="cpu")
            model.init_weights()
        return model
    return GPT(model_cfg)


def _tensor_bytes(t: torch.Tensor) -> memoryview:
    t = t.detach().cpu().contiguous()
    return ctypes.string_at(t.data_ptr(), t.numel() * t.element_size())


def one_rank_group(dist: DistEnv) -> None:
    """A process group of this one process (NCCL on CUDA, gloo on CPU) where there is none:
    the model, its collectives and state dicts are then those of many ranks."""
    if not torch_dist.is_initialized():
        torch_dist.init_process_group(dist.backend, store=torch_dist.HashStore(), rank=0, world_size=1,
                                      **process_group_options(dist.device))


class Strategy:
    """DDP: a full replica per rank (also the plain model when there is one process, unless
    trainer.ddp_one_process wraps it over a one-rank group)."""

    name = "ddp"
    sharded_snapshots = False  # snapshots: one file by rank 0 (snapshot.py)
    # Must every rank run each forward pass (FSDP gathers parameters in it)? DDP's model
    # alone runs on one rank (rank 0's sample preview).
    collective_forward = False
    # Why autocast's dtype cannot change mid-run (precision.RunCheck), or None: DDP's can.
    fixed_precision: Optional[str] = None

    def __init__(self, cfg: TrainerConfig, dist: DistEnv, model: GPT, precision: PrecisionPlan):
        self.cfg, self.dist, self.model, self.precision = cfg, dist, model, precision
        self.compiled = self.cfg.compile if self.cfg.compile is not None else self.dist.device.type == "cuda"
        # DDP wraps the model on many ranks, and on one when asked (trainer.ddp_one_process)
        self.wrapped = self.dist.is_distributed or self.cfg.ddp_one_process
        self.train_model = self._wrap()  # the model on its device, wrapped (and compiled) for training
        self.eval_model = self._eval_model()

    def _wrap(self) -> torch.nn.Module:
        self.model.to(self.dist.device)
        forward_model = torch.compile(self.model) if self.compiled else self.model
        if not self.wrapped:
            return forward_model
        one_rank_group(self.dist)  # (many ranks: setup() made the group)
        # Inside DDP's forward, torch.compile splits the graph at DDP's bucket boundaries
        # (DDPOptimizer), so the all-reduces still overlap the backward pass.
        from torch.nn.parallel import DistributedDataParallel as DDP

        return DDP(
            forward_model,
            device_ids=[self.dist.device.index] if self.dist.device.type == "cuda" else None,
            gradient_as_bucket_view=True,  # gradients are views into the all-reduce buckets: no copies
            bucket_cap_mb=ddp_bucket_cap_mb(self.cfg, self.dist.device.type),
            static_graph=self.cfg.ddp_static_graph,
        )

    def _eval_model(self) -> torch.nn.Module:
        """Compiled apart from training's DDP-wrapped model: eval mode and no_grad get their
        own graph, compiled at the first evaluation (without DDP's bucket splits)."""
        return torch.compile(self.model) if self.compiled else self.model

    # ---- the step ---------------------------------------------------------------------------
    def no_sync(self, last: bool) -> ContextManager:
        """Gradients are reduced once per optimizer step, in the last micro-step's backward."""
        if last or not self.wrapped:
            return contextlib.nullcontext()
        return self.train_model.no_sync()

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Clip to `max_norm`; returns the total norm before clipping, over all parameters (the
        tied head once), the same on every rank. Sharded gradients (FSDP) cost one all-reduce
        of the shards' norms, whatever placement torch leaves the norm in."""
        params = list(self.model.parameters())
        norm = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
        if hasattr(norm, "full_tensor"):
            norm = norm.full_tensor()
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
        return norm

    def grad_scaler(self) -> torch.amp.GradScaler:
        """fp16's loss scaler. Under FSDP each rank sees only its shards for inf/NaN: torch
        all-reduces the verdict inside unscale_ for DTensor gradients, so every rank skips
        (or takes) the same steps without a reduction of ours."""
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
        if self.cfg.ddp_static_graph and self.wrapped and accum_steps > 1:
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
    fixed_precision = "FSDP gathers the parameters in the compute dtype it was given when it sharded them"

    def __init__(self, cfg: TrainerConfig, dist: DistEnv, model: GPT, precision: PrecisionPlan):
        smallest = min(p.shape[0] for p in model.parameters())
        if smallest < dist.world_size:
            raise ConfigError(
                f"the model is too small to shard over {dist.world_size} processes: a parameter has only {smallest} "
                f"rows, so some processes would hold none of it (model.n_embd={model.cfg.n_embd}, "
                f"data.block_size={model.cfg.block_size}): use trainer.strategy=ddp (such a model fits on one "
                "device), or fewer processes"
            )
        super().__init__(cfg, dist, model, precision)

    def _wrap(self) -> torch.nn.Module:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        # One process: a one-rank group, so the model, its state dicts and snapshots are
        # the same DTensors as on many ranks (and a snapshot moves between world sizes).
        one_rank_group(self.dist)
        # Parameters are gathered in the compute dtype, gradients reduced in fp32 into fp32
        # master weights; autocast (precision.py) still keeps LayerNorm and softmax in fp32.
        low = self.precision.dtype if self.precision.name != "fp32" else None
        policy = MixedPrecisionPolicy(param_dtype=low, reduce_dtype=torch.float32)
        blocks = list(self.model.blocks)
        for i, block in enumerate(blocks):
            if self.compiled:
                # Each block compiled on its own, before sharding (torchtitan's order): one
                # graph serves every block, and FSDP's hooks (all-gather, reduce-scatter) run
                # outside it, around each block's compiled forward and backward.
                block.compile(fullgraph=True)
            # Parameters are freed after each block's forward and gathered again for its
            # backward, except the last block's, whose backward comes at once (torchtitan's choice).
            fully_shard(block, mp_policy=policy, reshard_after_forward=i < len(blocks) - 1)
        # The root: embeddings, ln_f, and the head tied to wte; its backward comes first too.
        fully_shard(self.model, mp_policy=policy, reshard_after_forward=False)
        if self.compiled:
            # The root's own work compiled too, as torchtitan compiles its loss apart from the
            # blocks: eager, the head's cross-entropy on fp32 logits would write and read the
            # (tokens x vocab) fp32 tensors several times (about 20 GB a micro-batch of 16 x 1024
            # at GPT-2's vocabulary). Its forward stays eager, so FSDP's root hooks (all-gather
            # before, reduce-scatter after) run outside the graphs, as around each block.
            self.model.embed = torch.compile(self.model.embed, fullgraph=True)
            self.model.head = torch.compile(self.model.head, fullgraph=True)
        if self.model.wte.weight.is_meta:  # built by build_model: fill in this rank's shards only
            self.model.to_empty(device=self.dist.device)
            self.model.init_weights(fill=_fill_shard)
        return self.model

    def _eval_model(self) -> torch.nn.Module:
        """The sharded model itself: its compiled blocks get a graph of their own for eval mode
        and no_grad at the first evaluation."""
        return self.model

    def no_sync(self, last: bool) -> ContextManager:
        """Non-last micro-steps accumulate unsharded gradients locally, without reduce-scatter,
        and keep the blocks' parameters gathered after their backward: the next micro-step's
        forward needs no all-gather (memory: one unsharded copy of the parameters, in the
        compute dtype, on top of the unsharded gradients). The last micro-step reshards."""
        self.model.set_requires_gradient_sync(last)
        self.model.set_reshard_after_backward(last)
        return contextlib.nullcontext()

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


def _fill_shard(param: torch.Tensor, value: torch.Tensor) -> None:
    """Write this rank's shard of `value` (the whole parameter, on the CPU) into the sharded
    `param`; no communication (every rank draws the same whole value)."""
    from torch.distributed.tensor import distribute_tensor

    param.copy_(distribute_tensor(value.to(param.device), param.device_mesh, param.placements, src_data_rank=None))


def make_strategy(cfg: TrainerConfig, dist: DistEnv, model: GPT, precision: PrecisionPlan) -> Strategy:
    """The strategy named by trainer.strategy, wrapping `model` (already on its device)."""
    name = strategy_name(cfg)
    if name not in STRATEGIES:
        raise ConfigError(f"trainer.strategy={name} is not known: use one of {', '.join(STRATEGIES)}")
    return (FSDPStrategy if name == "fsdp" else Strategy)(cfg, dist, model, precision)
