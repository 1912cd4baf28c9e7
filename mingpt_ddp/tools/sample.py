"""Generate text from a snapshot or an export.

    python -m mingpt_ddp.sample <snapshot file, run directory, URL or export directory> prompt="ROMEO:" max_new_tokens=300

Options are ``key=value`` pairs checked against :class:`SampleConfig` (prompt,
max_new_tokens, temperature, top_k, seed, device, cpu_threads).
"""
from __future__ import annotations

import os
import shlex
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
from mingpt_ddp.tools import export, trained, usage

USAGE = 'usage: python -m mingpt_ddp.sample <snapshot path | run dir | URL | export dir> [prompt="ROMEO:"] [max_new_tokens=300] [temperature=0.8] [top_k=null] [seed=0] [device=cpu] [cpu_threads=null]'


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


def load(target: str) -> trained.Trained:
    """The model at `target`: an export directory (export.read_export reads every format
    export writes) or else a snapshot (file, run directory, URL)."""
    return export.read_export(target) or trained.from_snapshot(target)


def generate_text(target: str, opts: SampleConfig) -> str:
    check_options(opts)
    found = load(target)
    if found.failed_check:
        print(f"warning: snapshot {storage.redact(found.where)} failed the end-of-run check ({found.failed_check}): "
              "its weights (rank 0's) may be wrong", file=sys.stderr, flush=True)
    tok = found.tokenizer  # the run's own: its characters, BPE or GPT-2's
    size_threads(opts)
    if torch.device(opts.device).type == "cpu":
        distributed.keep_freed_host_memory()  # each token's logits: 0.2 GB at GPT-2's vocabulary and block
    model = GPT(GPTConfig(**found.model_config))
    model.load_state_dict(found.state)
    model.to(opts.device).eval()
    prompt = opts.prompt or "\n"
    context = torch.from_numpy(tok.encode(prompt).astype("int64"))[None].to(opts.device)
    generator = torch.Generator(device=opts.device).manual_seed(opts.seed)
    out = model.generate(context, opts.max_new_tokens, opts.temperature, opts.top_k, generator=generator)
    return tok.decode(out[0].tolist())


def parse_args(argv: list[str]) -> tuple[str, SampleConfig]:
    _, argv = usage.options(argv, __doc__, USAGE)
    positional = [a for a in argv if "=" not in a]
    if len(positional) != 1:
        raise ConfigError(USAGE)
    schema = OmegaConf.structured(SampleConfig)
    try:
        # Values stay raw strings (a prompt like "ROMEO:" is not YAML); the schema converts types.
        pairs = dict(a.split("=", 1) for a in argv if "=" in a)
        prompt = pairs.pop("prompt", None)  # text as typed: "None", "${...}" are words to continue, not values
        values = {k: None if v.lower() in ("null", "none") else v for k, v in pairs.items()}
        threads = values.get("cpu_threads")
        if threads is not None and not threads.strip().lstrip("-").isdigit():
            distributed.cpu_threads(threads, 1, key="cpu_threads")  # not a number: its own one-line refusal
        merged = OmegaConf.merge(schema, values)
    except OmegaConfBaseException as exc:
        raise ConfigError(f"{exc.__class__.__name__}: {str(exc).splitlines()[0]}\n{USAGE}") from None
    opts = SampleConfig(**OmegaConf.to_container(merged))
    if prompt is not None:
        opts.prompt = prompt
    return positional[0], opts


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
            seconds: Optional[float] = PREVIEW_SECONDS, together: bool = False, prompt: Optional[str] = None) -> str:
    """A few lines the model just learned to write, and the command that samples more: how a
    run ends on rank 0. Dropout off, a fixed seed, the model left as it was found. It
    starts where a document starts: after a newline (characters) or <|endoftext|>. At most
    `tokens`, and no more after `seconds` (None: no time bound). `together`: every rank runs
    each forward (FSDP), so all must stop after the same chunk: rank 0's clock decides and
    is broadcast after each chunk (an unbounded FSDP sample took 9 s on an H200). `prompt`: the
    one the closing command suggests (corpus_prompt). One thread
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
            f"{cut}sample more: {sample_command(run_dir, prompt)}")


def corpus_prompt(tok: tokenizer.Tokenizer, val_tokens, max_chars: int = 24) -> Optional[str]:
    """A prompt for the closing command, from the run's own text: the first words (at most
    `max_chars` characters, whole words where it can) of the validation split's first whole
    line that has any, so that it means something in the corpus (not "ROMEO:" for Python
    source) and encodes in its vocabulary. None when no line fits."""
    text = tok.decode([int(t) for t in val_tokens[:400]])
    for line in text.split("\n")[1:-1]:  # whole lines: the split may cut the first and the last
        line = line.strip()
        if line and line.isprintable():
            cut = line[:max_chars]
            if len(line) > max_chars and " " in cut:
                cut = cut.rsplit(" ", 1)[0]
            return cut
    return None


def sample_command(run_dir: str, prompt: Optional[str] = None, max_new_tokens: int = 500) -> str:
    """The command that samples more from `run_dir`, ready to paste into the shell the run
    started from: the interpreter the run used (the quick start never activates the venv;
    relative where it is under the current directory, .venv/bin/python), the run directory
    likewise, every word shell-quoted."""
    def here(path: str) -> str:
        rel = os.path.relpath(os.path.abspath(path))
        return path if rel == os.pardir or rel.startswith(os.pardir + os.sep) else rel
    python = here(sys.executable)
    python = python if os.sep in python else os.curdir + os.sep + python  # a command, not a name to look up
    words = [python, "-m", "mingpt_ddp.sample", here(run_dir)]
    words += [f"prompt={prompt}"] if prompt else []
    return shlex.join([*words, f"max_new_tokens={max_new_tokens}"])


if __name__ == "__main__":
    cli()
