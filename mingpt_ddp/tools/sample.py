"""Generate text from a snapshot.

    python -m mingpt_ddp.sample <snapshot file, run directory or URL> prompt="ROMEO:" max_new_tokens=300

Options are ``key=value`` pairs checked against :class:`SampleConfig` (prompt,
max_new_tokens, temperature, top_k, seed, device, cpu_threads).
"""
from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from typing import Optional

import torch
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from mingpt_ddp import distributed
from mingpt_ddp.checkpoint import storage
from mingpt_ddp.corpus import tokenizer
from mingpt_ddp.errors import ConfigError
from mingpt_ddp.model import GPT, GPTConfig
from mingpt_ddp.checkpoint.snapshot import SnapshotStore

USAGE = 'usage: python -m mingpt_ddp.sample <snapshot path | run dir | URL> [prompt="ROMEO:"] [max_new_tokens=300] [temperature=0.8] [top_k=null] [seed=0] [device=cpu] [cpu_threads=null]'


@dataclass
class SampleConfig:
    prompt: str = "\n"
    max_new_tokens: int = 300
    temperature: float = 0.8
    top_k: Optional[int] = None
    seed: int = 0
    device: str = "cpu"
    # Threads (torch's intra-op and inter-op pools), as trainer.cpu_threads for a run; null: this
    # process's share of the cores (its affinity; a Slurm task's own CPUs) on CPU, torch's own on GPUs.
    cpu_threads: Optional[int] = None


# An unreachable store is retried this long before a clear error.
RETRY_MINUTES = 0.5


def snapshot_store_for(target: str) -> SnapshotStore:
    """A snapshot file, or a run directory holding snapshot.pt (local or any fsspec URL;
    credentials and endpoint from the environment, e.g. AWS_PROFILE, AWS_ENDPOINT_URL)."""
    fs, path = storage.filesystem(target)
    try:
        is_dir = storage.retry_transient(lambda: fs.isdir(path), f"reading {target}", RETRY_MINUTES)
    except Exception as exc:
        raise ConfigError(f"cannot read {target} ({storage.describe(exc)}): check the path, the endpoint "
                          "(AWS_ENDPOINT_URL) and the credentials") from None
    if is_dir:
        return SnapshotStore(target.rstrip("/") + "/snapshot.pt", retry_minutes=RETRY_MINUTES)
    return SnapshotStore(target, retry_minutes=RETRY_MINUTES)


def load_latest(target: str) -> Optional[tuple[dict, str]]:
    """(snapshot, where) of the newest snapshot at `target`, on this process alone: a DDP
    snapshot file, or an FSDP run's shards merged into the whole model (no process group).
    The snapshot has the model's state dict and the metadata (vocab, model_config,
    train_state, ...); None when there is none."""
    from mingpt_ddp.checkpoint.sharded_snapshot import is_sharded, load_full_model_state

    store = snapshot_store_for(target)
    if is_sharded(store.url):
        model_state, meta = load_full_model_state(store.url)
        return {**meta, "model": model_state}, store.display(store.path) + ".dcp"
    return store.load_latest()


def failed_check(snapshot: dict) -> Optional[str]:
    """The end-of-run check the snapshot failed (the ranks' parameters differed; its weights
    are rank 0's and may be wrong), in words; None if it failed none."""
    failed = snapshot.get("failed_check")
    if not failed:
        return None
    return str(failed.get("message") if isinstance(failed, dict) else failed)


def check_options(opts: SampleConfig) -> None:
    """Refuse options that would crash deep in torch or silently sample something else."""
    if opts.max_new_tokens < 0:
        raise ConfigError(f"max_new_tokens={opts.max_new_tokens} must be >= 0 (the number of tokens to add)")
    if opts.temperature < 0:
        raise ConfigError(f"temperature={opts.temperature} must be >= 0 (0: always the likeliest token, "
                          "1: the model's distribution, e.g. temperature=0.8)")
    if opts.top_k is not None and opts.top_k < 1:
        raise ConfigError(f"top_k={opts.top_k} must be at least 1 (sample among the k likeliest tokens), "
                          "or top_k=null for no limit")
    distributed.cpu_threads(opts.cpu_threads, 1, key="cpu_threads")


def size_threads(opts: SampleConfig) -> None:
    """cpu_threads, or this process's share of the cores on CPU, as a run sizes its pools."""
    if opts.cpu_threads is not None or torch.device(opts.device).type == "cpu":
        distributed.size_thread_pools(distributed.cpu_threads(opts.cpu_threads, 1, key="cpu_threads"),
                                      opts.cpu_threads is not None, 0, key="cpu_threads")


def generate_text(target: str, opts: SampleConfig) -> str:
    check_options(opts)
    found = load_latest(target)
    if found is None:
        raise ConfigError(f"no snapshot at {target}: give a snapshot file or a run directory that has one")
    snapshot, where = found
    failed = failed_check(snapshot)
    if failed:
        print(f"warning: snapshot {storage.redact(where)} failed the end-of-run check ({failed}): its weights (rank "
              "0's) may be wrong", file=sys.stderr, flush=True)
    tok = tokenizer.from_snapshot(snapshot)  # the run's own: its characters, BPE or GPT-2's
    size_threads(opts)
    if torch.device(opts.device).type == "cpu":
        distributed.keep_freed_host_memory()  # each token's logits: 0.2 GB at GPT-2's vocabulary and block
    model = GPT(GPTConfig(**snapshot["model_config"]))
    model.load_state_dict(snapshot["model"])
    model.to(opts.device).eval()
    prompt = opts.prompt or "\n"
    context = torch.from_numpy(tok.encode(prompt).astype("int64"))[None].to(opts.device)
    generator = torch.Generator(device=opts.device).manual_seed(opts.seed)
    out = model.generate(context, opts.max_new_tokens, opts.temperature, opts.top_k, generator=generator)
    return tok.decode(out[0].tolist())


def parse_args(argv: list[str]) -> tuple[str, SampleConfig]:
    positional = [a for a in argv if "=" not in a]
    if len(positional) != 1:
        raise ConfigError(USAGE)
    schema = OmegaConf.structured(SampleConfig)
    try:
        # Values stay raw strings (a prompt like "ROMEO:" is not YAML); the schema converts types.
        pairs = dict(a.split("=", 1) for a in argv if "=" in a)
        values = {k: None if v.lower() in ("null", "none") else v for k, v in pairs.items()}
        threads = values.get("cpu_threads")
        if threads is not None and not threads.strip().lstrip("-").isdigit():
            distributed.cpu_threads(threads, 1, key="cpu_threads")  # not a number: its own one-line refusal
        merged = OmegaConf.merge(schema, values)
    except OmegaConfBaseException as exc:
        raise ConfigError(f"{exc.__class__.__name__}: {str(exc).splitlines()[0]}\n{USAGE}") from None
    return positional[0], SampleConfig(**OmegaConf.to_container(merged))


def cli(argv: Optional[list[str]] = None) -> None:
    try:
        target, opts = parse_args(sys.argv[1:] if argv is None else argv)
        check_options(opts)
        text = generate_text(target, opts)
    except ConfigError as exc:
        if "characters outside the vocabulary" in str(exc):
            exc = ConfigError(f"prompt {exc}: use only characters the model was trained on")
        print(f"error: {storage.redact(str(exc))}", file=sys.stderr)
        raise SystemExit(ConfigError.exit_code)
    sys.stdout.write(text + "\n")


# The closing sample's bound in time where one process samples alone: on a busy machine
# 240 tokens could take a minute; it says how many it wrote when it stops early.
PREVIEW_SECONDS = 0.5
PREVIEW_TOKENS = 240


def preview_line(seconds: Optional[float] = PREVIEW_SECONDS, tokens: int = PREVIEW_TOKENS) -> str:
    """What rank 0 says before the closing sample: a run's last seconds are not silent."""
    bound = f" for up to {seconds:g} s" if seconds is not None else ""
    return (f"sampling up to {tokens} tokens from the trained model{bound} (its snapshot is saved: Ctrl-C "
            "now only ends the run)")


def _past(deadline: Optional[float], together: bool, device: torch.device) -> bool:
    """Whether sampling is out of time; with `together`, rank 0's answer on every rank."""
    late = deadline is not None and time.monotonic() >= deadline
    if together:
        flag = torch.tensor([int(late)], device=device)
        torch.distributed.broadcast(flag, src=0)
        late = bool(flag.item())
    return late


@torch.no_grad()
def preview(model: GPT, tok: tokenizer.Tokenizer, run_dir: str, tokens: int = PREVIEW_TOKENS, lines: int = 4,
            seconds: Optional[float] = PREVIEW_SECONDS, together: bool = False) -> str:
    """A few lines the model just learned to write, and the command that samples more: how a
    run ends on rank 0. Dropout off, a fixed seed, the model left as it was found. It
    starts where a document starts: after a newline (characters) or <|endoftext|>. At most
    `tokens`, and no more after `seconds` (None: no time bound). `together`: every rank runs
    each forward (FSDP), so all must stop after the same chunk: rank 0's clock decides and
    is broadcast after each chunk (an unbounded FSDP sample took 9 s on an H200). One thread
    on CPU: each token's passes are too small to share, and a thread waiting for a busy core
    made it 50x slower."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    if isinstance(tok, tokenizer.CharTokenizer):
        first = tok.encode("\n" if "\n" in tok.vocab.chars else tok.vocab.chars[0])
    else:
        first = tok.separator_ids
    out = torch.from_numpy(first.astype("int64"))[None].to(device)
    generator = torch.Generator(device=device).manual_seed(0)
    threads = torch.get_num_threads()
    if device.type == "cpu":
        torch.set_num_threads(1)
    deadline = None if seconds is None else time.monotonic() + seconds
    # Alone: the clock after every token (a chunk of a large model's tokens could take seconds on
    # one thread). Together: after every 4, each check a broadcast from rank 0.
    chunk = 4 if together else 1
    new: list[torch.Tensor] = []
    stream = model.stream(out, temperature=0.8, generator=generator)  # with a KV cache: the tokens of generate()
    try:
        # Eager, also where the blocks were compiled (FSDP): each new length would recompile them.
        with torch.compiler.set_stance("force_eager"):
            for token in stream if tokens > 0 else ():
                new.append(token)
                if len(new) == tokens or (len(new) % chunk == 0 and _past(deadline, together, device)):
                    break
    finally:
        stream.close()
        torch.set_num_threads(threads)
        model.train(was_training)
    out = torch.cat([out, *new], dim=1)
    written = out.size(1) - 1
    text = "\n".join(tok.decode(out[0, 1:].tolist()).strip("\n").splitlines()[:lines])
    shown = "\n".join("    " + line for line in text.splitlines())
    cut = f"sampling stopped after {seconds:g} s, at {written} of {tokens} tokens; " if written < tokens else ""
    return (f"a sample of what the model writes now:\n{shown}\n"
            f"{cut}sample more: python -m mingpt_ddp.sample {run_dir} prompt=\"ROMEO:\" max_new_tokens=500")


if __name__ == "__main__":
    cli()
