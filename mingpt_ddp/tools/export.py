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

With ``--hf`` (needs safetensors) the directory is instead Hugging Face transformers' GPT-2
(GPT2LMHeadModel) with its tokenizer, for ``AutoModelForCausalLM`` / ``AutoTokenizer``:

    config.json             GPT-2's config (hf_gpt2.hf_config), float32, <|endoftext|> as bos/eos
    model.safetensors       the weights in GPT-2's layout (hf_gpt2.to_hf), the tied head once
    generation_config.json  the token ids; ids of a padded vocabulary suppressed
    tokenizer.json          Hugging Face's tokenizer giving this run's ids (Tokenizer.hf_json)
    tokenizer_config.json   loads tokenizer.json as it is (PreTrainedTokenizerFast)
    mingpt_ddp.json         this project's side (read_hf_export): the model config, the
                            tokenizer's own state and the 'trained' metadata
"""
from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from typing import Any, Optional

import torch

from mingpt_ddp import model as model_module
from mingpt_ddp.checkpoint import hf_gpt2, storage
from mingpt_ddp.corpus import tokenizer
from mingpt_ddp.errors import ConfigError
from mingpt_ddp.tools import usage
from mingpt_ddp.tools.trained import Trained, failed_check, load_latest

USAGE = ("usage: python -m mingpt_ddp.export <run dir | snapshot file | URL> <out dir> [--safetensors] "
         "[--accept-failed-check] [--hf]")
FORMAT = "mingpt-ddp-export 1"
HF_FORMAT = "mingpt-ddp-hf-export 1"
SIDECAR = "mingpt_ddp.json"  # in an --hf directory: what transformers' files leave out


def export(source: str, out_dir: str, safetensors: bool = False, accept_failed_check: bool = False,
           hf: bool = False) -> dict[str, Any]:
    """Write weights.pt, config.json and model.py (and model.safetensors) to `out_dir`;
    return what config.json says. `accept_failed_check`: export a snapshot marked as failing
    the end-of-run check too (else refused). `hf`: write transformers' GPT-2 directory
    instead (write_hf); return what mingpt_ddp.json says."""
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
    if safetensors or hf:
        try:
            from safetensors.torch import save_model
        except ImportError:
            flag = "--hf" if hf else "--safetensors"
            raise ConfigError(f"{flag} needs safetensors: pip install safetensors (or pip install -e '.[hf]')") from None
    model = model_module.GPT(model_module.GPTConfig(**snapshot["model_config"]))
    model.load_state_dict(snapshot["model"])  # a state_dict that does not fit fails here, not at the user's
    tok = tokenizer.from_snapshot(snapshot)
    state = snapshot["train_state"]
    trained = {"step": state["step"], "epoch": state["epoch"], "tokens_seen": state["tokens_seen"],
               "val_loss": state.get("last_val_loss"), "source": storage.redact(where),
               "failed_check": snapshot.get("failed_check") or None}  # the end-of-run check it failed
    check_out_dir(out_dir)
    staging = tempfile.mkdtemp(prefix=f".{os.path.basename(os.path.abspath(out_dir))}.export-",
                               dir=os.path.dirname(os.path.abspath(out_dir)))
    try:
        if hf:
            meta = write_hf(model, snapshot["model_config"], tok, trained, staging)
        else:
            meta = write_plain(model, snapshot["model_config"], tok, trained, staging, safetensors)
        os.chmod(staging, 0o777 & ~_umask())  # mkdtemp's 0700 would follow it to out_dir
        _replace(staging, out_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return meta


def write_plain(model: model_module.GPT, model_config: dict[str, Any], tok: tokenizer.Tokenizer,
                trained: dict[str, Any], out_dir: str, safetensors: bool) -> dict[str, Any]:
    """This package's own format (module docstring); return what config.json says."""
    meta = {
        "format": FORMAT,
        "model_config": model_config,
        "tokenizer": {"kind": tok.kind, "file": tok.save(out_dir), "vocab_size": tok.size,
                      **({"eot_id": tok.eot_id} if tok.kind != "char" else {})},
        **({"vocab": list(tok.vocab.chars)} if tok.kind == "char" else {}),
        "trained": trained,
    }
    torch.save(model.state_dict(), os.path.join(out_dir, "weights.pt"))
    if safetensors:
        from safetensors.torch import save_model

        save_model(model, os.path.join(out_dir, "model.safetensors"))  # the tied head is stored once
    _write_json(os.path.join(out_dir, "config.json"), meta)
    shutil.copyfile(model_module.__file__, os.path.join(out_dir, "model.py"))
    return meta


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def is_export(directory: str) -> bool:
    """Whether `directory` holds an export (either format): what a new export may replace."""
    if os.path.isfile(os.path.join(directory, SIDECAR)):
        return True
    try:
        with open(os.path.join(directory, "config.json"), encoding="utf-8") as f:
            meta = json.load(f)
    except (OSError, ValueError):
        return False
    return isinstance(meta, dict) and meta.get("format") == FORMAT


def check_out_dir(out_dir: str) -> None:
    """A new or empty directory, or an earlier export (replaced whole); never a run directory
    or anything else with files in it. Local only: export writes a directory, then renames it."""
    if "://" in out_dir:
        raise ConfigError(f"the output directory {storage.redact(out_dir)} is a URL: export writes a local directory "
                          "(it appears whole, by a rename); upload it afterwards (e.g. aws s3 cp --recursive, "
                          "huggingface-cli upload)")
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise ConfigError(f"{out_dir} is a file: give a new directory for the export")
    if os.path.isdir(out_dir) and os.listdir(out_dir) and not is_export(out_dir):
        raise ConfigError(f"{out_dir} holds files that are not an export (a run directory?): give a new or empty "
                          "directory (an earlier export there is replaced whole)")


def _replace(staging: str, out_dir: str) -> None:
    """Put the finished export at `out_dir` by renames: a reader sees the old export or the new
    one, never a mix of the two (an export stopped half way leaves the old one as it was)."""
    if not os.path.isdir(out_dir):
        os.rename(staging, out_dir)
        return
    old = f"{staging}.old"
    os.rename(out_dir, old)
    try:
        os.rename(staging, out_dir)
    except BaseException:
        os.rename(old, out_dir)
        raise
    shutil.rmtree(old, ignore_errors=True)


def _write_json(path: str, value: Any) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(value, f, indent=2, ensure_ascii=False)
        f.write("\n")


def write_hf(model: model_module.GPT, model_config: dict[str, Any], tok: tokenizer.Tokenizer,
             trained: dict[str, Any], out_dir: str) -> dict[str, Any]:
    """transformers' GPT-2 directory of `model` and `tok` (module docstring); return the
    sidecar. <|endoftext|> is bos and eos for the BPEs (generate stops at a document's end);
    characters have neither (the newline that joins their documents also ends lines). Ids
    past the tokenizer's (a padded vocabulary) are suppressed in generation_config.json."""
    from safetensors.torch import save_file

    vocab_size = model_config["vocab_size"]
    if vocab_size < tok.size:
        raise ConfigError(f"the model has {vocab_size} token ids and its tokenizer {tok.size}: not a snapshot "
                          "this project wrote")
    eot = tok.eot_id
    block_size = model_config["block_size"]
    os.makedirs(out_dir, exist_ok=True)
    _write_json(os.path.join(out_dir, "config.json"),
                hf_gpt2.hf_config(model_config, bos_token_id=eot, eos_token_id=eot, torch_dtype="float32"))
    save_file(hf_gpt2.to_hf(model.state_dict(), model_config["n_layer"]),
              os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    padding = list(range(tok.size, vocab_size))
    _write_json(os.path.join(out_dir, "generation_config.json"),
                {"bos_token_id": eot, "eos_token_id": eot, "pad_token_id": eot,
                 **({"suppress_tokens": padding} if padding else {})})
    with open(os.path.join(out_dir, "tokenizer.json"), "w", encoding="utf-8") as f:
        f.write(tok.hf_json())
    special = {"bos_token": tokenizer.EOT, "eos_token": tokenizer.EOT} if eot is not None else {}
    _write_json(os.path.join(out_dir, "tokenizer_config.json"),
                {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": block_size,
                 "clean_up_tokenization_spaces": False, **special})
    sidecar = {"format": HF_FORMAT, "model_config": model_config, "tokenizer": tok.to_dict(), "trained": trained}
    if tok.kind == "gpt2":  # its ranks, so that this project reads the directory without tiktoken's cache
        sidecar["tokenizer_file"] = tok.save(out_dir)
    _write_json(os.path.join(out_dir, SIDECAR), sidecar)
    return sidecar


def read_hf_export(directory: str) -> tuple[dict[str, Any], dict[str, torch.Tensor], dict[str, Any], dict[str, Any]]:
    """(model_config for GPTConfig, the model's state dict, the tokenizer's state for
    tokenizer.from_dict, the 'trained' metadata) of a directory `export --hf` wrote (local or
    an fsspec URL). The weights are model.safetensors' (also after transformers saved the
    directory again); config.json must still have the sidecar's shape."""
    try:
        from safetensors.torch import load as load_safetensors
    except ImportError:
        raise ConfigError("reading an --hf export needs safetensors: pip install safetensors") from None
    fs, path = storage.filesystem(directory)
    where = storage.redact(directory)

    def read(name: str) -> bytes:
        try:
            with fs.open(f"{path.rstrip('/')}/{name}", "rb") as f:
                return f.read()
        except FileNotFoundError:
            raise ConfigError(f"{where} has no {name}: not a directory that python -m mingpt_ddp.export --hf "
                              "wrote") from None

    try:
        sidecar = json.loads(read(SIDECAR))
        config = json.loads(read("config.json"))
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{where}: unreadable JSON ({exc}): export it again") from None
    if not isinstance(sidecar, dict) or sidecar.get("format") != HF_FORMAT:
        raise ConfigError(f"{where}/{SIDECAR} is not format {HF_FORMAT!r}: export it again with this version")
    model_config = sidecar["model_config"]
    shape = hf_gpt2.model_config_from_hf(config, f"{where}/config.json")
    ours = {"gelu": "exact", **model_config}
    differ = sorted(k for k in shape if ours.get(k) != shape[k])
    if differ:
        raise ConfigError(f"{where}/config.json no longer matches {SIDECAR} ({', '.join(differ)}): export it again")
    try:
        weights = load_safetensors(read("model.safetensors"))
    except Exception as exc:  # cut short or damaged
        raise ConfigError(f"cannot read {where}/model.safetensors ({type(exc).__name__}: {exc}): export it again") from None
    state = hf_gpt2.from_hf(weights, model_config["n_layer"])
    return model_config, state, sidecar["tokenizer"], sidecar["trained"]
def read_export(directory: str) -> Optional[Trained]:
    """An export directory read back (what `python -m mingpt_ddp.sample <dir>` samples from);
    None when `directory` is not one (no config.json: a run directory, a snapshot file, a URL;
    or a snapshot beside it: the run's newest weights, not an older export's).
    Each format export writes is read here, by what its config.json says."""
    path = os.path.join(directory, "config.json")
    if "://" in directory or not os.path.isfile(path) or os.path.exists(os.path.join(directory, "snapshot.pt")):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            meta = json.load(f)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read {path} ({exc}): export the run again") from None
    if isinstance(meta, dict) and meta.get("format") == FORMAT:
        return _read_own(directory, meta)
    if os.path.isfile(os.path.join(directory, SIDECAR)):  # an --hf directory: transformers' config.json
        return _read_hf(directory)
    raise ConfigError(f"{path} is not an export this version reads (its format: "
                      f"{meta.get('format') if isinstance(meta, dict) else None!r}, expected {FORMAT!r})")


def _read_own(directory: str, meta: dict[str, Any]) -> Trained:
    """This package's own format (FORMAT): weights.pt, config.json and the tokenizer's file."""
    spec = meta["tokenizer"]
    tok = tokenizer.from_export(directory, spec["kind"], spec.get("file"), meta.get("vocab"), spec.get("eot_id"))
    try:
        state = torch.load(os.path.join(directory, "weights.pt"), map_location="cpu", weights_only=True)
    except Exception as exc:  # cut short, damaged or not tensors only
        raise ConfigError(f"cannot read {os.path.join(directory, 'weights.pt')} ({type(exc).__name__}: "
                          f"{str(exc).splitlines()[0] if str(exc) else ''}): export the run again") from None
    failed = (meta.get("trained") or {}).get("failed_check")
    return Trained(meta["model_config"], state, tok, directory,
                   str(failed.get("message") if isinstance(failed, dict) else failed) if failed else None)


def _read_hf(directory: str) -> Trained:
    """An --hf directory (read_hf_export), with its tokenizer rebuilt from the sidecar."""
    model_config, state, tokenizer_state, trained = read_hf_export(directory)
    with open(os.path.join(directory, SIDECAR), encoding="utf-8") as f:
        ranks_file = json.load(f).get("tokenizer_file")
    if ranks_file:  # GPT-2's ranks beside it: no tiktoken cache needed
        tok = tokenizer.from_export(directory, tokenizer_state["kind"], ranks_file)
    else:
        tok = tokenizer.from_dict(tokenizer_state)
    failed = trained.get("failed_check")
    return Trained(model_config, state, tok, directory,
                   str(failed.get("message") if isinstance(failed, dict) else failed) if failed else None)


def cli(argv: Optional[list[str]] = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    try:
        flags, positional = usage.options(argv, __doc__, USAGE, {"--safetensors", "--accept-failed-check", "--hf"})
        if len(positional) != 2:
            raise ConfigError(f"give a run directory, snapshot file or URL and an output directory ({USAGE})")
        if {"--hf", "--safetensors"} <= set(flags):
            raise ConfigError("--hf writes model.safetensors already: drop --safetensors")
        meta = export(positional[0], positional[1], safetensors="--safetensors" in flags,
                      accept_failed_check="--accept-failed-check" in flags, hf="--hf" in flags)
    except ConfigError as exc:
        print(f"error: {storage.redact(str(exc))}", file=sys.stderr)
        raise SystemExit(ConfigError.exit_code)
    trained = meta["trained"]
    if trained["failed_check"]:
        print("warning: exported although it failed the end-of-run check (--accept-failed-check); "
              f"{SIDECAR if '--hf' in flags else 'config.json'} records it", file=sys.stderr)
    print(f"exported step {trained['step']} (val_loss {trained['val_loss']}) from {trained['source']} to {positional[1]}")


if __name__ == "__main__":
    cli()
