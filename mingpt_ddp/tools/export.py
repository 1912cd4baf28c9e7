"""Export a trained model for people who do not have this package.

    python -m mingpt_ddp.export <run dir | snapshot file | URL> <out dir>

An FSDP run's sharded snapshot is merged into the whole model on this process. A snapshot
file starts with a header line and holds the optimizer and RNG states too, so plain
``torch.load`` cannot read it. The export directory holds only the model:

    weights.pt     the model's state_dict: tensors only, read with torch.load(weights_only=True)
    config.json    the model's shape (model_config), the tokenizer (its kind and file; for
                   characters the vocabulary itself: character i has id i), and where the
                   weights came from (step, validation loss, source)
    tokenizer.json a BPE's tokenizer (Hugging Face's format), or gpt2.tiktoken GPT-2's BPE
                   ranks (tiktoken's format); none for characters
    model.py       the model definition: a copy of mingpt_ddp/model.py, which needs only torch

Plain PyTorch loads it with `model.py` on the path (see README "Export"). weights.pt rather
than safetensors: it loads with torch alone, and weights_only=True refuses anything but
tensors and plain containers. With ``--safetensors`` (needs `pip install safetensors`)
model.safetensors is written too, for tools that read that format. A snapshot marked as
failing the end-of-run check (the ranks' parameters differed) is refused unless
``--accept-failed-check`` is given; config.json then records the failed check.
"""
from __future__ import annotations

import json
import os
import shutil
import sys
from typing import Any, Optional

import torch

from mingpt_ddp import model as model_module
from mingpt_ddp.checkpoint import storage
from mingpt_ddp.corpus import tokenizer
from mingpt_ddp.errors import ConfigError
from mingpt_ddp.tools import usage
from mingpt_ddp.tools.trained import Trained, failed_check, load_latest

USAGE = ("usage: python -m mingpt_ddp.export <run dir | snapshot file | URL> <out dir> [--safetensors] "
         "[--accept-failed-check]")
FORMAT = "mingpt-ddp-export 1"


def export(source: str, out_dir: str, safetensors: bool = False, accept_failed_check: bool = False) -> dict[str, Any]:
    """Write weights.pt, config.json and model.py (and model.safetensors) to `out_dir`;
    return what config.json says. `accept_failed_check`: export a snapshot marked as failing
    the end-of-run check too (else refused)."""
    found = load_latest(source)
    if found is None:
        raise ConfigError(f"no snapshot at {source}: give a snapshot file or a run directory that has one")
    snapshot, where = found
    failed = failed_check(snapshot)
    if failed and not accept_failed_check:
        raise ConfigError(
            f"snapshot {storage.redact(where)} failed the end-of-run check ({failed}): its weights (rank 0's) may be "
            "wrong; compare the nodes' environments, or pass --accept-failed-check to export it anyway (config.json "
            "then records the failed check)")
    if safetensors:
        try:
            from safetensors.torch import save_model
        except ImportError:
            raise ConfigError("--safetensors needs safetensors: pip install safetensors") from None
    model = model_module.GPT(model_module.GPTConfig(**snapshot["model_config"]))
    model.load_state_dict(snapshot["model"])  # a state_dict that does not fit fails here, not at the user's
    tok = tokenizer.from_snapshot(snapshot)
    state = snapshot["train_state"]
    os.makedirs(out_dir, exist_ok=True)
    meta = {
        "format": FORMAT,
        "model_config": snapshot["model_config"],
        "tokenizer": {"kind": tok.kind, "file": tok.save(out_dir), "vocab_size": tok.size,
                      **({"eot_id": tok.eot_id} if tok.kind != "char" else {})},
        **({"vocab": list(tok.vocab.chars)} if tok.kind == "char" else {}),
        "trained": {"step": state["step"], "epoch": state["epoch"], "tokens_seen": state["tokens_seen"],
                    "val_loss": state.get("last_val_loss"), "source": storage.redact(where),
                    "failed_check": snapshot.get("failed_check") or None},  # the end-of-run check it failed
    }
    torch.save(model.state_dict(), os.path.join(out_dir, "weights.pt"))
    if safetensors:
        save_model(model, os.path.join(out_dir, "model.safetensors"))  # the tied head is stored once
    with open(os.path.join(out_dir, "config.json"), "w", encoding="utf-8") as f:
        json.dump(meta, f, indent=2, ensure_ascii=False)
        f.write("\n")
    shutil.copyfile(model_module.__file__, os.path.join(out_dir, "model.py"))
    return meta


def read_export(directory: str) -> Optional[Trained]:
    """An export directory read back (what `python -m mingpt_ddp.sample <dir>` samples from);
    None when `directory` is not one (no config.json: a run directory, a snapshot file, a URL).
    Each format export writes is read here, by what its config.json says."""
    path = os.path.join(directory, "config.json")
    if "://" in directory or not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            meta = json.load(f)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read {path} ({exc}): export the run again") from None
    if isinstance(meta, dict) and meta.get("format") == FORMAT:
        return _read_own(directory, meta)
    raise ConfigError(f"{path} is not an export this version reads (its format: "
                      f"{meta.get('format') if isinstance(meta, dict) else None!r}, expected {FORMAT!r})")


def _read_own(directory: str, meta: dict[str, Any]) -> Trained:
    """This package's own format (FORMAT): weights.pt, config.json and the tokenizer's file."""
    spec = meta["tokenizer"]
    tok = tokenizer.from_export(directory, spec["kind"], spec.get("file"), meta.get("vocab"), spec.get("eot_id"))
    state = torch.load(os.path.join(directory, "weights.pt"), map_location="cpu", weights_only=True)
    failed = (meta.get("trained") or {}).get("failed_check")
    return Trained(meta["model_config"], state, tok, directory,
                   str(failed.get("message") if isinstance(failed, dict) else failed) if failed else None)


def cli(argv: Optional[list[str]] = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    try:
        flags, positional = usage.options(argv, __doc__, USAGE, {"--safetensors", "--accept-failed-check"})
        if len(positional) != 2:
            raise ConfigError(f"give a run directory, snapshot file or URL and an output directory ({USAGE})")
        meta = export(positional[0], positional[1], safetensors="--safetensors" in flags,
                      accept_failed_check="--accept-failed-check" in flags)
    except ConfigError as exc:
        print(f"error: {storage.redact(str(exc))}", file=sys.stderr)
        raise SystemExit(ConfigError.exit_code)
    trained = meta["trained"]
    if trained["failed_check"]:
        print("warning: exported although it failed the end-of-run check (--accept-failed-check); config.json "
              "records it", file=sys.stderr)
    print(f"exported step {trained['step']} (val_loss {trained['val_loss']}) from {trained['source']} to {positional[1]}")


if __name__ == "__main__":
    cli()
