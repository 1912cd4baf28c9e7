"""Encode a corpus ahead of a job, e.g. on the head node, into the token cache the job uses:

    python -m mingpt_ddp.prepare data.path='/fsx/corpora/fineweb/*.parquet' data.tokenizer=bpe \
        data.vocab_size=32768 data.cache_dir=/fsx/cache/tokens

Arguments are the training run's overrides (`data.*`, `experiment=...`, and
`trainer.cpu_threads=N` to encode on N threads instead of every core this process may use;
the rest of the config is ignored): the job then finds the token file (and the trained BPE)
made and starts without reading the text. With data.cache_dir on storage every node shares, this
one process encodes for the whole cluster; on node-local caches run it on every node
(`srun --ntasks-per-node=1 python -m mingpt_ddp.prepare ...`). Prints what it made.
"""
from __future__ import annotations

import logging
import os
import sys
from typing import Optional

from mingpt_ddp import config, distributed
from mingpt_ddp.checkpoint import storage
from mingpt_ddp.corpus import token_cache
from mingpt_ddp.errors import ConfigError, UserFacingError
from mingpt_ddp.tools import usage

USAGE = "usage: python -m mingpt_ddp.prepare data.path=... [data.tokenizer=bpe data.vocab_size=N data.cache_dir=DIR ...]"


def prepare(overrides: list[str]) -> token_cache.TokenFile:
    cfg = config.compose(overrides, job_name="prepare")
    storage.resolve_secrets(cfg, [])  # as main() does: refused or redacted wherever shown
    options = storage.resolve_options(cfg.data.storage_options, "data.storage_options")
    storage.remember_secrets(storage.secret_option_values(options))
    # One process: trainer.cpu_threads threads where set, else this process's cores (as one run process would).
    threads = distributed.encode_threads(config.cpu_threads_setting(cfg.trainer), 1)
    return token_cache.prepare(cfg.data.path, cfg.data.download_url, options, cfg.data.cache_dir,
                               cfg.trainer.load_retry_minutes, tokenization=token_cache.tokenization(cfg.data),
                               threads=threads)


def cli(argv: Optional[list[str]] = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    try:
        _, argv = usage.options(argv, __doc__, USAGE)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(ConfigError.exit_code)
    if not argv:
        print(__doc__.strip() + "\n\n" + USAGE, file=sys.stderr)
        raise SystemExit(ConfigError.exit_code)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    storage.redact_logs()
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    try:
        made = prepare(argv)
    except UserFacingError as exc:
        print(f"error: {storage.redact(str(exc))}", file=sys.stderr)
        raise SystemExit(ConfigError.exit_code)
    except (HydraException, OmegaConfBaseException) as exc:  # an unknown key or a wrong type
        print(f"error: {storage.redact(str(exc).splitlines()[0])}\n{USAGE}", file=sys.stderr)
        raise SystemExit(ConfigError.exit_code)
    where = os.path.join(token_cache.tokens_dir(config.compose(argv, job_name="prepare").data.cache_dir), made.name)
    how = (f"encoded in {made.encode_s:.1f} s ({made.corpus_bytes / 1e6 / max(made.encode_s, 1e-9):.1f} MB/s)"
           if made.encode_s is not None else "already there: nothing to do")
    print(f"{made.corpus}: {made.corpus_bytes / 1e6:,.1f} MB -> {made.length:,} tokens ({made.dtype}) in {where}; {how}")


if __name__ == "__main__":
    cli()
