"""parallel.py from inside, on 2 gloo ranks (tests/fsdp_worker.py under torchrun): FSDP built
on the meta device, compiled block by block, evaluation compiled once, the collectives of
fp16 scaling and clipping, gradient accumulation without re-gathering, and DDP/FSDP parity."""
import json
import subprocess

import pytest

from conftest import REPO, TORCHRUN, output

pytestmark = [pytest.mark.dist, pytest.mark.slow]


SCENARIOS = ["init", "collectives", "accumulation", "compiled:ddp", "compiled:fsdp", "parity:bf16"]


@pytest.fixture(scope="module")
def observed(tmp_path_factory):
    """Every scenario of tests/fsdp_worker.py, in one torchrun launch: scenario -> each rank's observations."""
    out = tmp_path_factory.mktemp("fsdp_worker")
    proc = subprocess.run([TORCHRUN, "--standalone", "--nproc_per_node=2", str(REPO / "tests" / "fsdp_worker.py"),
                           str(out), *SCENARIOS], cwd=REPO, capture_output=True, text=True, timeout=600)
    files = {s: out / f"{s.replace(':', '-')}.json" for s in SCENARIOS}
    return {s: json.loads(f.read_text()) for s, f in files.items() if f.exists()}, proc


def observations(observed, scenario):
    results, proc = observed
    assert proc.returncode == 0 and scenario in results, output(proc)
    return results[scenario]


def test_fsdp_builds_on_the_meta_device_and_each_rank_fills_in_the_ddp_weights_of_its_shards(observed):
    for rank in observations(observed, "init"):
        assert rank["built_on_meta"] and rank["sharded"] and rank["tied"], rank
        assert rank["mismatched"] == [], rank  # bit for bit the weights DDP starts from (same seed)
        assert rank["init_from_mismatched"] == [] and rank["init_from_tied"], rank  # model.init_from's, in the shards
        assert 0.45 * rank["elements"] < rank["local_elements"] < 0.55 * rank["elements"], rank


def train_and_eval_graphs(result):
    return ([g for g in result["graphs"] if g["grad"]], [g for g in result["graphs"] if not g["grad"]])


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_compiled_training_matches_eager_and_evaluation_compiles_once(observed, strategy):
    """trainer.compile=true (aot_eager, counted) against eager from the same seed, 4 steps of
    2 micro-batches with clipping, then the final evaluation over the whole split (its last
    batch short) and two more evaluations: the same losses, one training graph, and one
    evaluation graph compiled at the first evaluation and run by every later one. Under
    FSDP each is three: a block's (run once per block per pass), and the root's embeddings
    and its head with the loss (once per pass), so nothing of the model runs eagerly."""
    ranks = observations(observed, f"compiled:{strategy}")
    eager, compiled = ranks[0]["runs"]["eager"], ranks[0]["runs"]["compiled"]  # rank 0's metrics.jsonl
    assert [r["step"] for r in compiled] == [1, 2, 3, 4, 4, 4, 4]
    for a, b in zip(eager, compiled):
        for key in ("train_loss", "val_loss", "grad_norm"):
            assert (a.get(key) is None) == (b.get(key) is None), (a, b)
            if a.get(key) is not None:
                assert b[key] == pytest.approx(a[key], rel=1e-5), (key, a, b)
    assert all(r["grad_norm"] > 0 for r in compiled if "train_loss" in r)  # logged at log_every

    for rank in ranks:
        train, evaluation = train_and_eval_graphs(rank)
        assert len(rank["graphs_after_fit"]) == len(rank["graphs"])  # later evaluations compiled nothing
        if strategy == "ddp":  # the whole model in one graph
            assert len(train) == 1 and len(evaluation) == 1, rank["graphs"]
            assert train[0]["embedding"] and train[0]["head"]
            parts = {"model": (train[0], evaluation[0], 1)}
        else:
            assert rank["blocks_compiled"] == [True] * rank["n_layer"]
            assert len(train) == 3 and len(evaluation) == 3, rank["graphs"]
            parts = {}
            for name, pick in (("block", lambda g: not g["embedding"] and not g["head"]),
                               ("embedding", lambda g: g["embedding"] and not g["head"]),
                               ("head", lambda g: g["head"] and not g["embedding"])):
                found = [g for g in train if pick(g)], [g for g in evaluation if pick(g)]
                assert [len(f) for f in found] == [1, 1], (name, rank["graphs"])
                parts[name] = (found[0][0], found[1][0], rank["n_layer"] if name == "block" else 1)
        for name, (train_graph, eval_graph, per_pass) in parts.items():
            assert train_graph["calls"] == 4 * 2 * per_pass, (name, rank["graphs"])
            later = rank["eval_passes_per_evaluation"] * 2 * per_pass  # the two evaluations after fit
            fit_eval = [g for g in rank["graphs_after_fit"] if not g["grad"] and g["embedding"] == eval_graph["embedding"]
                        and g["head"] == eval_graph["head"]][0]["calls"]
            assert fit_eval > 0 and eval_graph["calls"] == fit_eval + later, (name, rank["graphs"])


def test_fp16_under_fsdp_reduces_found_inf_once_and_every_rank_skips_the_step(observed):
    """An inf in rank 1's shard alone: torch's GradScaler all-reduces the verdict for DTensor
    gradients itself (one all_reduce in unscale_, ours was a second), clipping costs one more,
    and both ranks skip the step and halve the scale."""
    for rank in observations(observed, "collectives"):
        assert rank["unscale"] == {"all_reduce": 1}, rank
        assert rank["clip"] == {"all_reduce": 1}, rank
        assert rank["changed"] == [], rank
        assert rank["scale_after"] == rank["scale_before"] / 2, rank


def test_fsdp_accumulation_keeps_parameters_gathered_between_micro_steps(observed):
    """The second micro-step's forward needs no all-gather (the first one's backward left the
    blocks unsharded); after the last micro-step every block is resharded."""
    for rank in observations(observed, "accumulation"):
        first, last = rank["micro_steps"]
        assert first["forward"].get("_allgather_base_", 0) == rank["n_layer"] + 1, rank  # blocks and root
        assert first["blocks_sharded_after_backward"] == [False] * rank["n_layer"], rank
        assert last["forward"] == {}, rank
        assert last["blocks_sharded_after_backward"] == [True] * rank["n_layer"], rank
        assert "_reduce_scatter_base_" not in first["backward"] and last["backward"]["_reduce_scatter_base_"] > 0


def test_ddp_and_fsdp_bf16_losses_agree(observed):
    """bf16 from the same seed and data: DDP (autocast, fp32 residual stream) and FSDP (bf16
    parameters and activations, fp32 gradient reduction) log losses within 1% over 20 steps."""
    result = observations(observed, "parity:bf16")[0]
    ddp, fsdp = result["ddp"], result["fsdp"]
    assert [r["step"] for r in ddp] == [r["step"] for r in fsdp] == [5, 10, 15, 20, 20]
    for a, b in zip(ddp, fsdp):
        key = "train_loss" if "train_loss" in a else "val_loss"
        assert abs(a[key] - b[key]) <= 0.01 * a[key], (ddp, fsdp)
    assert fsdp[-2]["train_loss"] < fsdp[0]["train_loss"] - 0.3, fsdp  # it learned: the steps were real
