"""Corpus files to token ids: tokenizers, document shards (Parquet, JSON lines), encoding, and the per-node token cache."""
