"""The corpus: tokenizers, text encodings, document readers and the per-node token cache that char_dataset.py maps."""
