"""The docs cannot drift from the code: the configuration page's table against config.py,
every conf/ preset against the schema, every relative link in the docs."""
import math
import re
from pathlib import Path
from urllib.parse import unquote

import pytest
import yaml
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from conftest import REPO
from mingpt_ddp import config

pytestmark = pytest.mark.unit

CONFIG_PAGE = REPO / "docs" / "configuration.md"
DOCS = [REPO / "README.md", REPO / "tests" / "README.md", REPO / "data" / "README.md",
        *sorted((REPO / "docs").glob("*.md")), *sorted((REPO / "benchmarks").glob("*.md"))]
# Defaults the table describes in words: their values are checked by other tests (test_config.py).
DESCRIBED = {"from the preset", "tiny-shakespeare's, for the preset's own path"}


def composed(*overrides):
    config.register()
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


def table_rows(text):
    """(keys, default) of each row of the first `| key | default | meaning |` table."""
    lines = text.split("\n")
    start = next(i for i, line in enumerate(lines) if line.startswith("| key | default |"))
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        key_cell, default_cell = [c.strip() for c in line.strip("|").split(" | ")[:2]]
        yield re.findall(r"`([^`]+)`", key_cell), default_cell


def split_top_level(text):
    """'6e-4, [0.9, 0.95]' -> ['6e-4', '[0.9, 0.95]']: commas inside brackets stay."""
    parts, depth, current = [], 0, ""
    for ch in text:
        depth += ch in "[{" and 1 or ch in "]}" and -1 or 0
        if ch == "," and depth == 0:
            parts.append(current.strip())
            current = ""
        else:
            current += ch
    return [p for p in [*parts, current.strip()] if p]


def documented(value):
    value = value.strip("`")
    return None if value == "null" else yaml.safe_load(value)


def same(doc, actual):
    actual = getattr(actual, "value", actual)
    if isinstance(actual, float) or isinstance(doc, float):
        return doc is not None and actual is not None and math.isclose(float(doc), float(actual), rel_tol=1e-9)
    if isinstance(actual, (list, tuple)):
        return list(doc) == [getattr(a, "value", a) for a in actual]
    if isinstance(actual, dict):
        return doc == actual
    return doc == actual or (isinstance(actual, str) and str(doc) == actual)


def schema_keys(cfg):
    def leaves(node, prefix):
        for key, value in node.items():
            if isinstance(value, dict) and value and key != "storage_options":
                yield from leaves(value, f"{prefix}{key}.")
            else:
                yield f"{prefix}{key}"
    container = OmegaConf.to_container(cfg, resolve=False)
    return {k for k in leaves(container, "") if not k.startswith("hydra")}


def test_every_row_of_the_configuration_table_is_the_code_default():
    cfg = composed()
    checked, wrong = 0, []
    for keys, default in table_rows(CONFIG_PAGE.read_text()):
        dotted = [k.split(" ")[0] for k in keys if re.fullmatch(r"[a-z_]+(\.[a-z_0-9]+)+", k)]
        if default in DESCRIBED or not dotted:
            continue
        values = split_top_level(default)
        assert len(values) == len(dotted), f"row {keys}: {len(dotted)} keys but defaults {values}"
        for key, value in zip(dotted, values):
            actual = OmegaConf.select(cfg, key, throw_on_missing=False)
            if not same(documented(value), actual):
                wrong.append(f"{key}: documented {value}, code {actual!r}")
            checked += 1
    assert not wrong, wrong
    assert checked >= 50


def test_the_group_defaults_in_the_table_are_the_codes():
    rows = {keys[0]: default for keys, default in table_rows(CONFIG_PAGE.read_text()) if keys}
    assert rows["model="].strip("`") == "gpt-mini"
    assert OmegaConf.to_container(composed().model) == OmegaConf.to_container(composed("model=gpt-mini").model)
    assert rows["logger="] == "none"
    assert not any(composed().logger[name].enabled for name in ("tensorboard", "mlflow", "wandb"))


def test_every_schema_key_is_in_the_configuration_table():
    text = CONFIG_PAGE.read_text()
    in_table = {k.split(" ")[0] for keys, _ in table_rows(text) for k in keys}
    missing = sorted(schema_keys(composed()) - in_table)
    assert not missing, f"keys of config.py missing from docs/configuration.md: {missing}"


def test_the_readmes_short_table_agrees_with_the_configuration_page():
    full = {k: d for keys, d in table_rows(CONFIG_PAGE.read_text()) for k in keys}
    short = list(table_rows((REPO / "README.md").read_text().split("## Configuration", 1)[1]))
    assert len(short) >= 12
    for keys, default in short:
        for key in keys:
            if key in full and "," not in full[key]:
                assert full[key] == default, (key, default, full[key])


PRESETS = sorted(f"{group.name}={path.stem}" for group in (REPO / "conf").iterdir() if group.is_dir()
                 and group.name not in ("hydra",) for path in group.glob("*.yaml"))


@pytest.mark.parametrize("override", PRESETS)
def test_every_preset_composes_against_the_schema_and_validates(override):
    """A preset with a key the schema lacks, a wrong type or an invalid value fails here,
    not at a user's first run."""
    cfg = composed(override)
    config.validate(cfg)


def test_the_presets_are_all_found():
    assert {"model=gpt-nano", "model=gpt2", "experiment=char_cpu_fast", "experiment=shakespeare_char_cpu",
            "logger=mlflow"} <= set(PRESETS)


def anchors(path):
    """GitHub's anchors for a Markdown file's headings (duplicates get -1, -2, ...)."""
    seen, found = {}, set()
    in_code = False
    for line in path.read_text().split("\n"):
        if line.startswith("```"):
            in_code = not in_code
        if in_code or not re.match(r"#{1,6} ", line):
            continue
        slug = re.sub(r"[^\w\- ]", "", line.lstrip("#").strip().lower().replace("`", "")).replace(" ", "-")
        n = seen.get(slug, 0)
        found.add(slug if n == 0 else f"{slug}-{n}")
        seen[slug] = n + 1
    return found


def links(path):
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    return re.findall(r"\]\(([^)\s]+)\)", text)


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_resolves(doc):
    broken = []
    for link in links(doc):
        if re.match(r"[a-z]+:", link):
            continue  # http(s), mailto: not ours to check offline
        target, _, anchor = link.partition("#")
        path = (doc.parent / unquote(target)).resolve() if target else doc
        if not path.exists():
            broken.append(link)
        elif anchor and path.suffix == ".md" and anchor not in anchors(path):
            broken.append(link)
    assert not broken, f"{doc.relative_to(REPO)}: {broken}"


def test_the_link_checker_sees_a_broken_link(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# Title\n\n[ok](#title) [gone](#nowhere) [file](missing.md)\n")
    assert anchors(page) == {"title"}
    assert [link for link in links(page) if link.partition("#")[2] not in anchors(page)] == ["#nowhere", "missing.md"]


def test_readme_is_a_short_document_with_the_promised_commands():
    text = (REPO / "README.md").read_text()
    assert text.count("\n") <= 300
    assert ("python3 -m venv .venv && .venv/bin/pip install -q torch==2.13.0 -e . && .venv/bin/mingpt-torchrun "
            "--standalone --nproc_per_node=2 mingpt_ddp/main.py\n") in text
    assert "\nbash tests/setup.sh && .venv/bin/python -m pytest\n" in text
    assert (REPO / ".ci" / "run").read_text().rstrip().endswith("bash tests/setup.sh && .venv/bin/python -m pytest")
    assert len(list((REPO / "docs").glob("*.md"))) >= 8 and (REPO / "benchmarks" / "RESULTS.md").exists()
    assert (REPO / "LICENSE").exists()


@pytest.mark.unit
def test_the_documented_gpt2_runs_are_real_configurations():
    """Issue 30: `model=gpt2` on Shakespeare's characters at block 128 never left warm-up on 32
    GPUs. Every documented training command at GPT-2 size takes GPT-2's tokens at block 1024
    and a corpus of its own, and composes against the schema."""
    docs = [REPO / "README.md", *(REPO / "docs").glob("*.md")]
    commands = []
    for path in docs:
        for command in path.read_text().replace("\\\n", " ").splitlines():
            if re.search(r"(main\.py|train\.sbatch|multinode\.sh) .*model=gpt2\b", command) and "bench" not in command:
                commands.append((path.name, command))
    assert len(commands) >= 6, commands
    for name, command in commands:
        assert "data.tokenizer=gpt2" in command and "data.block_size=1024" in command and "data.path=" in command, \
            (name, command)
        overrides = [w for w in command.split("#")[0].split() if re.match(r"^(model|data|trainer)\.?\w*=", w)]
        composed(*overrides)
