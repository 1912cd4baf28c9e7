"""Build ~1 MB benchmark texts unlike tiny-shakespeare from files every Debian/Ubuntu machine has.

    .venv/bin/python benchmarks/texts.py OUT_DIR [--mb 1.0]

Writes OUT_DIR/{python,german,man,logs}.txt (nothing is downloaded, nothing is committed):

- python.txt: the source of the installed torch package (torch/**/*.py, sorted by path);
- german.txt: the German translations (msgstr) of /usr/share/locale/de/LC_MESSAGES/*.mo;
- man.txt: raw groff source of the section-1 man pages (/usr/share/man/man1/*.gz);
- logs.txt: the plain-text logs under /var/log (dpkg, apt, alternatives, ...; rotated
  .gz/.xz ones decompressed).

Each is cut at the last newline before `--mb` megabytes. The exact bytes depend on the
packages installed, so a figure names the machine it was taken on.
"""
from __future__ import annotations

import argparse
import gettext
import gzip
import lzma
import os
from pathlib import Path


def python_source() -> str:
    import torch

    root = Path(torch.__file__).parent
    return "".join(p.read_text(encoding="utf-8", errors="replace") for p in sorted(root.rglob("*.py")))


def german_messages() -> str:
    parts = []
    for mo in sorted(Path("/usr/share/locale/de/LC_MESSAGES").glob("*.mo")):
        try:
            with open(mo, "rb") as f:
                catalog = gettext.GNUTranslations(f)
        except (OSError, ValueError, UnicodeDecodeError):
            continue
        for key, value in catalog._catalog.items():  # msgid -> msgstr; plural forms keyed (msgid, n)
            if key and isinstance(value, str) and value.strip():
                parts.append(value.strip() + "\n")
    return "".join(parts)


def man_pages() -> str:
    parts = []
    for page in sorted(Path("/usr/share/man/man1").glob("*.gz")):
        try:
            parts.append(gzip.open(page, "rt", encoding="utf-8", errors="replace").read())
        except (OSError, EOFError):
            continue
    return "".join(parts)


def logs() -> str:
    parts = []
    for path in sorted(Path("/var/log").rglob("*.log*")):
        opener = {".gz": gzip.open, ".xz": lzma.open}.get(path.suffix, open)
        try:
            with opener(path, "rb") as f:
                data = f.read()
        except (OSError, EOFError, lzma.LZMAError):
            continue
        if data and b"\0" not in data[:4096]:
            parts.append(data.decode("utf-8", errors="replace"))
    return "".join(parts)


BUILDERS = {"python": python_source, "german": german_messages, "man": man_pages, "logs": logs}


def cut(text: str, limit: int) -> str:
    if len(text.encode("utf-8")) <= limit:
        return text
    text = text.encode("utf-8")[:limit].decode("utf-8", errors="ignore")
    return text[: text.rfind("\n") + 1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path)
    p.add_argument("--mb", type=float, default=1.0)
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    for name, build in BUILDERS.items():
        text = cut(build(), int(args.mb * 1e6))
        path = args.out / f"{name}.txt"
        path.write_text(text, encoding="utf-8")
        print(f"{path}: {len(text.encode('utf-8')) / 1e6:.2f} MB, {len(set(text))} distinct characters")
    os.sync()


if __name__ == "__main__":
    main()
