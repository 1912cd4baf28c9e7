"""The checkpoint stack: snapshots (DDP and FSDP) with their background savers, the stores they go to (local, FSx, S3 via fsspec), the run lock and run-directory checks."""
