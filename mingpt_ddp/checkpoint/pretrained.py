"""Starting from GPT-2-format weights (``model.init_from=<directory>``), as nanoGPT's
``init_from=gpt2``: a transformers GPT-2 checkpoint directory (config.json, and
model.safetensors, its model.safetensors.index.json shards, or pytorch_model.bin).

* The shape comes from the checkpoint (settle_config): its config.json gives model.n_layer,
  n_head, n_embd and gelu, written into the run's config, so snapshots record what trained.
  The preset's values (the default gpt-mini, an experiment's) are replaced; a value given on
  the command line (``model.n_layer=...``, or a ``model=<preset>`` whose shape differs) that
  disagrees is one error. ``data.block_size`` may be shorter than the checkpoint's positions
  (the position embeddings are cropped, as nanoGPT's crop_block_size), never longer.
* The ids: a GPT-2 checkpoint's token ids are GPT-2's BPE, so it needs ``data.tokenizer=gpt2``
  and a vocabulary of exactly its 50,257 tokens (no padded vocabularies).
* The weights are read by rank 0 alone and sent to the others over the process group (only
  rank 0's node needs the directory); every rank maps them to this model's names and keeps
  them on the CPU until the model is filled in (parallel.build_model: the whole model under
  DDP, each rank's shards under FSDP).
* A run's snapshots record its starting weights (identity: the sha256 of the weight files'
  bytes, and the directory for display). A resume loads its snapshot, never the weights
  again, but hashes them: another content, or init_from set or unset, is refused in one line
  (check_same_start).
"""
from __future__ import annotations

import hashlib
import io
import json
import os
from dataclasses import dataclass
from typing import Any, Iterable, Optional

import torch

from mingpt_ddp import distributed
from mingpt_ddp.checkpoint import hf_gpt2
from mingpt_ddp.errors import ConfigError

SAFETENSORS, SAFETENSORS_INDEX = "model.safetensors", "model.safetensors.index.json"
BIN, BIN_INDEX = "pytorch_model.bin", "pytorch_model.bin.index.json"
SHAPE = ("n_layer", "n_head", "n_embd", "gelu")  # model.* keys the checkpoint decides
PRESET_SHAPE = ("n_layer", "n_head", "n_embd")  # of those, what a model=<preset> sets
GPT2_VOCAB = 50257  # GPT-2's BPE (corpus/tokenizer.py's GPT2_VOCAB)
_HASH_CHUNK = 16 << 20
WHAT = "a GPT-2 checkpoint directory (config.json and model.safetensors or pytorch_model.bin)"


def _refuse(directory: str, what: str) -> ConfigError:
    return ConfigError(f"model.init_from={directory}: {what}")


def read_config(directory: str) -> dict[str, Any]:
    """GPTConfig's fields from the checkpoint's config.json (hf_gpt2.model_config_from_hf)."""
    path = os.path.join(directory, "config.json")
    if not os.path.isdir(directory):
        raise _refuse(directory, f"no such directory: give {WHAT}, on the node of rank 0")
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except FileNotFoundError:
        raise _refuse(directory, f"no config.json there: give {WHAT}") from None
    except (OSError, ValueError) as exc:
        raise _refuse(directory, f"cannot read config.json ({exc})") from None
    return hf_gpt2.model_config_from_hf(config, path)


def explicit_keys(overrides: Iterable[str]) -> dict[str, str]:
    """model.* shape keys the command line gives ({key: how it gave it}): `model.n_layer=4`
    itself, or a `model=<preset>` choice (its n_layer, n_head, n_embd)."""
    found: dict[str, str] = {}
    for override in overrides:
        key, _, value = override.lstrip("+~").partition("=")
        if key == "model":
            found.update({k: f"model={value}" for k in PRESET_SHAPE if k not in found})
        elif key.startswith("model.") and key[6:] in SHAPE:
            found[key[6:]] = override.lstrip("+~")
    return found


def settle_config(cfg: Any, overrides: Iterable[str] = ()) -> Optional[str]:
    """With model.init_from set: write the checkpoint's shape and gelu into cfg.model (in
    place), after checking the command line's own values, data.block_size and the tokenizer
    against it. Returns a line for the log, or None without init_from. `overrides`: the
    command line's (Hydra's task overrides)."""
    from omegaconf import open_dict

    directory = cfg.model.get("init_from")
    if not directory:
        return None
    theirs = read_config(directory)
    for key, given in explicit_keys(overrides).items():
        mine = getattr(cfg.model[key], "value", cfg.model[key])
        if mine != theirs[key]:
            raise _refuse(directory, f"the checkpoint has {key}={theirs[key]} but the command line's {given} gives "
                                     f"{mine}: drop {given} (the checkpoint decides the model's shape)")
    kind = getattr(cfg.data.tokenizer, "value", cfg.data.tokenizer)
    if kind != "gpt2":
        raise _refuse(directory, f"its token ids are GPT-2's BPE but data.tokenizer={kind} gives other ids: set "
                                 "data.tokenizer=gpt2")
    if theirs["vocab_size"] != GPT2_VOCAB:
        raise _refuse(directory, f"the checkpoint's vocab_size={theirs['vocab_size']} is not GPT-2's {GPT2_VOCAB} "
                                 "tokens (data.tokenizer=gpt2): give a checkpoint with GPT-2's vocabulary")
    if cfg.data.block_size > theirs["block_size"]:
        raise _refuse(directory, f"data.block_size={cfg.data.block_size} is longer than the checkpoint's "
                                 f"{theirs['block_size']} positions: set data.block_size={theirs['block_size']} "
                                 "or less")
    with open_dict(cfg):
        for key in SHAPE:
            cfg.model[key] = theirs[key]
    crop = (f", its {theirs['block_size']} positions cropped to data.block_size={cfg.data.block_size}"
            if cfg.data.block_size < theirs["block_size"] else "")
    return (f"model.init_from={directory}: the model's shape from its config.json (n_layer={theirs['n_layer']}, "
            f"n_head={theirs['n_head']}, n_embd={theirs['n_embd']}, gelu={theirs['gelu']}){crop}")


def weight_files(directory: str) -> list[str]:
    """The weight files, by name, in the order they are read: model.safetensors (or the
    shards its index names), else pytorch_model.bin (or its shards)."""
    for single, index in ((SAFETENSORS, SAFETENSORS_INDEX), (BIN, BIN_INDEX)):
        if os.path.isfile(os.path.join(directory, single)):
            return [single]
        path = os.path.join(directory, index)
        if os.path.isfile(path):
            try:
                with open(path, encoding="utf-8") as f:
                    names = sorted(set(json.load(f)["weight_map"].values()))
            except (OSError, ValueError, KeyError, AttributeError) as exc:
                raise _refuse(directory, f"cannot read {index} ({exc})") from None
            missing = [n for n in names if not os.path.isfile(os.path.join(directory, n))]
            if missing:
                raise _refuse(directory, f"{index} names {', '.join(missing[:3])}, not there")
            return names
    raise _refuse(directory, f"no {SAFETENSORS} or {BIN} (nor their .index.json shards) there: give {WHAT}")


@dataclass
class Start:
    """The starting weights: their identity (plain types: it travels in snapshots) and, on a
    fresh start, this model's state dict (None on a resume, which never reads them)."""
    identity: dict[str, Any]
    weights: Optional[dict[str, torch.Tensor]]

    def take_weights(self) -> Optional[dict[str, torch.Tensor]]:
        """The state dict, given up here: once the model holds the values nothing else keeps a
        whole copy for the run (every holder of this Start shares the cleared field)."""
        weights, self.weights = self.weights, None
        return weights


def recorded_start(snapshot: Optional[dict[str, Any]], start: Optional[Start]) -> Optional[dict[str, Any]]:
    """What a new snapshot records as its starting weights: on a resume the snapshot's (where
    the weights came from, also when trainer.continue_with_new_settings let another
    model.init_from through), on a fresh start this one's."""
    if snapshot is not None:
        return snapshot.get("init_from")
    return start.identity if start is not None else None


def _read(directory: str, keep: bool) -> tuple[dict[str, Any], list[bytes]]:
    """Rank 0: the identity, and the files' bytes when `keep` (else only hashed, streamed)."""
    names = weight_files(directory)
    digest, blobs = hashlib.sha256(), []
    try:
        for name in names:
            digest.update(name.encode() + b"\0")
            with open(os.path.join(directory, name), "rb") as f:
                if keep:
                    blobs.append(f.read())
                    digest.update(blobs[-1])
                else:
                    while chunk := f.read(_HASH_CHUNK):
                        digest.update(chunk)
    except OSError as exc:
        raise _refuse(directory, f"cannot read its weights ({exc})") from None
    return {"path": os.path.abspath(directory), "files": names, "sha256": digest.hexdigest()}, blobs


def _decode(name: str, blob: Any) -> dict[str, torch.Tensor]:
    if name.endswith(".safetensors"):
        try:
            from safetensors.torch import load
        except ImportError:
            raise ConfigError(f"model.init_from: {name} needs the safetensors package: pip install -e '.[hf]'") from None
        return load(bytes(blob))
    # tensors and plain containers only: a pickle's code is never run
    return torch.load(io.BytesIO(blob), map_location="cpu", weights_only=True)


def read(directory: str, dist: Any, model_cfg: Any, fresh: bool) -> Start:
    """The starting weights' identity on every rank (rank 0 reads, the others receive), and
    on a `fresh` start the weights themselves, as this model's state dict for `model_cfg`
    (the position embeddings cropped to its block_size)."""
    kept: list[bytes] = []

    def on_rank0() -> tuple[dict[str, Any], list[int]]:
        identity, blobs = _read(directory, keep=fresh)
        kept.extend(blobs)
        return identity, [len(b) for b in blobs]

    identity, sizes = distributed.on_main_then_share(on_rank0, dist)
    if not fresh:
        return Start(identity, None)
    state: dict[str, torch.Tensor] = {}
    for i, (name, size) in enumerate(zip(identity["files"], sizes)):
        blob = distributed.broadcast_bytes(kept[i] if kept else None, size)
        state.update(distributed.on_every_rank(lambda: _decode_or_refuse(directory, name, blob), dist))
        del blob
    kept.clear()
    weights = hf_gpt2.from_hf(state, model_cfg.n_layer)
    weights["wpe.weight"] = weights["wpe.weight"][: model_cfg.block_size]
    rows = weights["wte.weight"].shape[0]
    if rows != model_cfg.vocab_size:
        raise _refuse(directory, f"its token embeddings have {rows} rows, config.json says vocab_size="
                                 f"{model_cfg.vocab_size}: the checkpoint is inconsistent")
    return Start(identity, weights)


def _decode_or_refuse(directory: str, name: str, blob: Any) -> dict[str, torch.Tensor]:
    try:
        return _decode(name, blob)
    except ConfigError:
        raise
    except Exception as exc:  # a damaged file, or a pickle with more than tensors in it
        if isinstance(exc, __import__("pickle").UnpicklingError) and "weights_only" in str(exc):
            raise _refuse(directory, f"{name} holds more than tensors (a pickle that would run code when loaded: "
                                     "it was not); convert it to model.safetensors where you trust it") from None
        raise _refuse(directory, f"cannot load {name} ({type(exc).__name__}: {str(exc).splitlines()[0][:200]})") \
            from None


def _short(identity: dict[str, Any]) -> str:
    return f"{identity.get('path')} (sha256 {str(identity.get('sha256'))[:12]}..)"


def start_changed(saved: Optional[dict[str, Any]], now: Optional[dict[str, Any]]) -> Optional[str]:
    """How this run's starting weights (`now`: Start.identity, None without init_from) differ
    from those a snapshot's run started from (`saved`; None: random weights, as every
    snapshot from before init_from existed), or None when they are the same bytes."""
    if not saved and not now:
        return None
    if not saved:
        return f"it started from random weights, and model.init_from={now['path']} now"
    if not now:
        return f"it started from the weights at {_short(saved)}, and model.init_from is null now"
    if saved.get("sha256") != now["sha256"]:
        return (f"the weights at model.init_from changed since it started from them: {_short(saved)} then, "
                f"{_short(now)} now")
    return None
