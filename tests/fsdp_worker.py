"""A torchrun worker for tests/test_fsdp_parallel.py: the real Trainer and parallel.py on gloo
ranks, observed from inside (graphs compiled, collectives issued, shards held), which the
CLI's output cannot show.

    fsdp_worker.py <out_dir> <scenario>[:<arg>] ...

The scenarios run one after the other in one process group (one launch, seconds saved per
test); each writes <out_dir>/<scenario>[-<arg>].json (rank 0: a list of every rank's
observations), on which the tests assert. Scenarios:
    init                 under FSDP the model is built on the meta device; each rank's filled-in
                         shards against the whole model built on the CPU from the same seed,
                         and against given starting weights (model.init_from)
    compiled:<strategy>  trainer.compile=true (a counting aot_eager backend) against eager:
                         losses, which graphs were compiled, and how often each ran
    collectives          fp16 under FSDP: an inf on one rank only; the collectives of unscale_
                         and clipping, and what every rank's scaler and weights do
    accumulation         FSDP with 2 micro-batches: all-gathers per micro-step, shards held
    parity:<precision>   DDP and FSDP from the same seed: the logged losses of each
"""
import json
import os
import sys

import torch

from mingpt_ddp import distributed, parallel
from mingpt_ddp.char_dataset import CharCorpus
from mingpt_ddp.config import OptimizerConfig, Precision, Strategy, TrainerConfig
from mingpt_ddp.metrics import MetricsLog
from mingpt_ddp.model import GPT, GPTConfig
from mingpt_ddp.precision import PrecisionPlan
from mingpt_ddp.trainer import Trainer

CORPUS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "tinyshakespeare-40k.txt")
MODEL = dict(block_size=16, n_layer=2, n_head=2, n_embd=32, dropout=0.0)


def make_trainer(dist, out_dir, name, strategy, **trainer_kw):
    corpus = CharCorpus(open(CORPUS, encoding="utf-8").read()[:20_000], 0.1)
    cfg = TrainerConfig(**{"batch_size": 4, "precision": Precision.fp32, "log_every": 1, "eval_every": 1000,
                           "eval_batches": 2, "strategy": Strategy(strategy), **trainer_kw})
    torch.manual_seed(0)  # as main.py: the same initial weights on every rank
    model = parallel.build_model(cfg, GPTConfig(vocab_size=corpus.vocab.size, **MODEL))
    torch.manual_seed(1 + dist.rank)
    metrics = MetricsLog(os.path.join(out_dir, f"{name}.jsonl") if dist.is_main else None, enabled=dist.is_main,
                         total_steps=0)
    return Trainer(cfg, OptimizerConfig(warmup_steps=0, lr=3e-3), model, corpus, dist, metrics, saver=None,
                   snapshot_metadata={})


def logged(dist, out_dir, name):
    """What rank 0 logged (None on the other ranks, which log nothing)."""
    if not dist.is_main:
        return None
    return [json.loads(line) for line in open(os.path.join(out_dir, f"{name}.jsonl"))]


def is_sharded(p) -> bool:
    return hasattr(p, "to_local")


def count_comms(mode) -> dict[str, int]:
    return {str(op).split(".")[-1]: n for op, n in mode.get_comm_counts().items()}


# ---- scenarios -------------------------------------------------------------------------------
def init(dist, out_dir):
    cfg = TrainerConfig(strategy=Strategy.fsdp, precision=Precision.fp32)
    gpt_cfg = GPTConfig(vocab_size=65, **{**MODEL, "block_size": 32})
    torch.manual_seed(7)
    model = parallel.build_model(cfg, gpt_cfg)
    built_on_meta = all(p.is_meta for p in model.parameters())
    strategy = parallel.make_strategy(cfg, dist, model, PrecisionPlan("fp32", dist.device.type))
    torch.manual_seed(7)
    whole = GPT(gpt_cfg)  # the DDP path: built whole on the CPU
    reference = whole.state_dict()
    mismatched = [name for name, p in strategy.model.state_dict().items()
                  if not torch.equal(p.full_tensor().cpu(), reference[name])]
    # model.init_from's starting weights (whole, on every rank's CPU) go into each rank's shards
    generator = torch.Generator().manual_seed(11)
    given = {name: torch.randn(t.shape, generator=generator) for name, t in reference.items() if name != "lm_head.weight"}
    given["lm_head.weight"] = given["wte.weight"]
    started = parallel.make_strategy(cfg, dist, parallel.build_model(cfg, gpt_cfg, given),
                                     PrecisionPlan("fp32", dist.device.type))
    started_mismatched = [name for name, p in started.model.state_dict().items()
                          if not torch.equal(p.full_tensor().cpu(), given[name])]
    return {"built_on_meta": built_on_meta, "mismatched": mismatched, "init_from_mismatched": started_mismatched,
            "init_from_tied": started.model.lm_head.weight is started.model.wte.weight,
            "tied": strategy.model.lm_head.weight is strategy.model.wte.weight,
            "sharded": all(is_sharded(p) for p in strategy.model.parameters()),
            "local_elements": sum(p.to_local().numel() for p in strategy.model.parameters()),
            "elements": sum(p.numel() for p in whole.parameters()),
            "fingerprint": strategy.fingerprint()}


def compiled(dist, out_dir, strategy_name):
    """Two runs from the same seed: eager, then compiled through a backend that records each
    graph it is given (was grad on: training, or off: evaluation) and counts its calls."""
    graphs = []
    real_compile = torch.compile

    def counting_backend(gm, example_inputs):
        from torch._dynamo.backends.registry import lookup_backend

        record = {"grad": torch.is_grad_enabled(), "calls": 0,
                  "inputs": sum(1 for n in gm.graph.nodes if n.op == "placeholder"),
                  "embedding": any("wte" in n.name for n in gm.graph.nodes),
                  "head": any("ln_f" in n.name for n in gm.graph.nodes)}
        graphs.append(record)
        inner = lookup_backend("aot_eager")(gm, example_inputs)

        def run(*args):
            record["calls"] += 1
            return inner(*args)
        return run

    def compile_counting(*args, **kwargs):
        kwargs["backend"] = counting_backend
        return real_compile(*args, **kwargs)

    common = dict(max_steps=4, grad_accum_steps=2, grad_clip=0.05)
    runs = {}
    for name, compile_on in (("eager", False), ("compiled", True)):
        torch.compiler.reset()
        torch.compile = compile_counting if compile_on else real_compile
        try:
            trainer = make_trainer(dist, out_dir, f"{strategy_name}-{name}", strategy_name, compile=compile_on, **common)
            trainer.fit()  # 4 steps; at the end one evaluation of 2 batches
            after_fit = [dict(g) for g in graphs]
            trainer.evaluate()
            trainer.evaluate()
        finally:
            torch.compile = real_compile
        trainer.metrics.close()
        runs[name] = logged(dist, out_dir, f"{strategy_name}-{name}")
    blocks_compiled = [getattr(b, "_compiled_call_impl", None) is not None for b in trainer.model.blocks]
    return {"runs": runs, "graphs_after_fit": after_fit, "graphs": graphs, "n_layer": MODEL["n_layer"],
            "eval_passes_per_evaluation": 2, "blocks_compiled": blocks_compiled}


def collectives(dist, out_dir):
    from torch.distributed.tensor.debug import CommDebugMode

    trainer = make_trainer(dist, out_dir, "collectives", "fsdp", precision=Precision.fp16, grad_clip=1.0)
    assert trainer.scaler.is_enabled()
    x, y = next(trainer.step_batches())[0]
    with trainer.precision.autocast():
        _, loss = trainer.strategy.train_model(x, y)
    trainer.scaler.scale(loss).backward()
    if dist.rank == 1:  # an overflow in rank 1's shard alone
        with torch.no_grad():
            trainer.model.blocks[0].mlp.fc.weight.grad.to_local().view(-1)[0] = float("inf")
    before = {n: p.full_tensor().clone() for n, p in trainer.model.named_parameters()}
    scale_before = trainer.scaler.get_scale()
    with CommDebugMode() as unscale_mode:
        trainer.scaler.unscale_(trainer.optimizer)
    with CommDebugMode() as clip_mode:
        norm = trainer.strategy.clip_grad_norm_(1.0)
    trainer.scaler.step(trainer.optimizer)
    trainer.scaler.update()
    changed = [n for n, p in trainer.model.named_parameters() if not torch.equal(p.full_tensor(), before[n])]
    return {"unscale": count_comms(unscale_mode), "clip": count_comms(clip_mode), "norm": norm.item(),
            "changed": changed, "scale_before": scale_before, "scale_after": trainer.scaler.get_scale()}


def accumulation(dist, out_dir):
    from torch.distributed.tensor.debug import CommDebugMode

    trainer = make_trainer(dist, out_dir, "accumulation", "fsdp", grad_accum_steps=2)
    micro_batches = next(trainer.step_batches())
    seen = []
    for i, (x, y) in enumerate(micro_batches):
        last = i == len(micro_batches) - 1
        with CommDebugMode() as forward_mode:
            with trainer.strategy.no_sync(last):
                _, loss = trainer.strategy.train_model(x, y)
        with CommDebugMode() as backward_mode:
            with trainer.strategy.no_sync(last):
                (loss / len(micro_batches)).backward()
        seen.append({"forward": count_comms(forward_mode), "backward": count_comms(backward_mode),
                     "blocks_sharded_after_backward": [all(is_sharded(p) for p in b.parameters())
                                                       for b in trainer.model.blocks]})
    return {"micro_steps": seen, "n_layer": MODEL["n_layer"]}


def parity(dist, out_dir, precision_name):
    for strategy_name in ("ddp", "fsdp"):
        trainer = make_trainer(dist, out_dir, f"parity-{strategy_name}", strategy_name, max_steps=20, log_every=5,
                               precision=Precision(precision_name), grad_clip=1.0)
        trainer.fit()
        trainer.metrics.close()
    return {s: logged(dist, out_dir, f"parity-{s}") for s in ("ddp", "fsdp")}


SCENARIOS = {"init": init, "compiled": compiled, "collectives": collectives, "accumulation": accumulation,
             "parity": parity}


def main() -> None:
    out_dir, *scenarios = sys.argv[1:]
    dist = distributed.setup()
    for scenario in scenarios:
        name, *args = scenario.split(":")
        result = SCENARIOS[name](dist, out_dir, *args)
        every_rank = distributed.all_gather_object(result)
        if dist.is_main:
            with open(os.path.join(out_dir, f"{'-'.join([name, *args])}.json"), "w") as f:
                json.dump(every_rank, f, indent=1, default=str)
    distributed.shutdown(clean=True)


if __name__ == "__main__":
    main()
