"""Snapshots and where they live: encoding, stores (DDP and sharded FSDP), their savers, storage via fsspec, and the locks that keep one writer per run."""
