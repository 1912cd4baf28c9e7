"""mingpt-ddp: a minGPT trainer for multi-node PyTorch DDP."""
