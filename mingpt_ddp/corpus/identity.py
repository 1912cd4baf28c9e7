"""What a run trains on, recorded in its snapshots and results, so that a resume on other text
is told from a resume on the same text.

A corpus's identity: the hash of its text (token_cache.py's ``text_sha256``, taken while the
cache is made: nothing is read twice), its training and validation token counts, and the data
settings that decide what is trained on and where the split falls (``data.path`` as shown,
``data.text_column``, ``data.val_fraction``; the tokenizer is the snapshot's own, checked
elsewhere). The text's hash decides: the same text under another ``data.path`` (a moved
directory, another mount) is the same corpus. Another text, another split (``val_fraction``)
or other token counts are another corpus: the validation text would partly have been trained
on, and the saved position in the epoch would index another permutation of windows.
"""
from __future__ import annotations

from typing import Any, Mapping, NamedTuple, Optional

from mingpt_ddp.checkpoint import storage

SETTINGS = ("path", "text_column", "val_fraction")  # the data.* keys an identity records
SPLIT = ("val_fraction",)  # of those, what changes the corpus even over the same text


def identity(text_sha256: str, train_tokens: int, val_tokens: int, data: Mapping[str, Any]) -> dict[str, Any]:
    """The identity of a corpus (plain types: it travels in snapshots and result.json).
    `data`: the run's data.* settings, secrets redacted."""
    return {"text_sha256": text_sha256, "train_tokens": int(train_tokens), "val_tokens": int(val_tokens),
            **{key: data.get(key) for key in SETTINGS}}


class Comparison(NamedTuple):
    """`changed`: what makes the corpus another one (for one line), or None. `note`: what
    differs without making it another one, or why nothing could be compared, or None."""
    changed: Optional[str]
    note: Optional[str]


def _same(key: str, then: Any, now: Any) -> bool:
    """data.path by what it names: a presigned URL signed anew is the same path."""
    if key == "path" and isinstance(then, str) and isinstance(now, str):
        return storage.location(then) == storage.location(now)
    return then == now


def _settings_diff(then: Mapping[str, Any], now: Mapping[str, Any], keys) -> list[str]:
    return [f"data.{key} {then.get(key)} then, {now.get(key)} now" for key in keys
            if not _same(key, then.get(key), now.get(key))]


def _tokens(ident: Mapping[str, Any]) -> str:
    return f"{ident['train_tokens']:,}/{ident['val_tokens']:,}"


def compare(saved: Optional[Mapping[str, Any]], saved_data: Optional[Mapping[str, Any]],
            now: Mapping[str, Any]) -> Comparison:
    """The corpus a snapshot was trained on (`saved`: its identity, or None for a snapshot
    written before identities were recorded; `saved_data`: the data.* settings of its
    config) against this run's (`now`)."""
    if not saved or "text_sha256" not in saved:
        # An older snapshot: its text is unknown; its config still says where the text was
        # and where the split fell: those of its keys it has (a key added since, such as
        # data.text_column, had its default then; nothing to compare it with).
        diff = _settings_diff(saved_data, now, [k for k in SETTINGS if k in saved_data]) if saved_data else []
        if diff:
            return Comparison(f"{'; '.join(diff)} (the snapshot predates recorded corpus hashes, so only these "
                              "settings can be compared)", None)
        return Comparison(None, "the snapshot predates recorded corpus identities: its text cannot be compared "
                                + ("(the data settings it recorded are as they are now)"
                                   if saved_data else "(nor its data settings)")
                                + "; snapshots saved from now on record it")
    same_text = saved["text_sha256"] == now["text_sha256"]
    same_tokens = (saved.get("train_tokens"), saved.get("val_tokens")) == (now["train_tokens"], now["val_tokens"])
    split = _settings_diff(saved, now, SPLIT)
    moved = _settings_diff(saved, now, [k for k in SETTINGS if k not in SPLIT])
    if same_text and same_tokens and not split:
        return Comparison(None, f"{'; '.join(moved)}: the same text (sha256 {now['text_sha256'][:12]}), resumed"
                          if moved else None)
    parts = list(split)
    if not same_text:
        parts += moved
        parts.append(f"the text at data.path changed (sha256 {saved['text_sha256'][:12]}.. then, "
                     f"{now['text_sha256'][:12]}.. now; "
                     f"{saved.get('train_tokens', 0) + saved.get('val_tokens', 0):,} tokens then, "
                     f"{now['train_tokens'] + now['val_tokens']:,} now)")
    else:
        parts.append(f"training/validation tokens {_tokens(saved)} then, {_tokens(now)} now")
    return Comparison("; ".join(parts), None)
