"""The oldest torch the code runs on (issue 23 item 1): one floor everywhere, an older torch
refused in one line before anything runs (also for a checkout run without pip, as in a
container), and every private torch API the code leans on either gone or with a fallback
that these tests compare with torch's own, so a torch release that removes one is noticed."""
from __future__ import annotations

import inspect
import pickle
import re
import subprocess
import time
from pathlib import Path

import pytest
import torch

from conftest import MAIN, REPO, output
from mingpt_ddp import dependencies

FLOOR = ".".join(map(str, dependencies.TORCH_FLOOR))


# ---- one floor -------------------------------------------------------------------------------
@pytest.mark.unit
@pytest.mark.parametrize("version, release", [
    ("2.9.0", (2, 9, 0)), ("2.9.1+cu128", (2, 9, 1)), ("2.9.0a0+git1f2e3d4", (2, 9, 0)), ("2.10.0.dev20250101+cpu", (2, 10, 0)),
    ("2.13.0+cpu", (2, 13, 0)), ("2.8.0", (2, 8, 0)), ("2.5.1+cu124", (2, 5, 1)), ("3.0.0rc1", (3, 0, 0)),
])
def test_release_of_a_torch_version(version, release):
    assert dependencies.release(version) == release


@pytest.mark.unit
def test_versions_below_the_floor_are_refused_and_the_floor_and_above_pass():
    for ok in ("2.9.0", "2.9.0a0+gitabc", "2.10.1", "3.0.0"):
        assert dependencies.torch_too_old_message(ok) is None, ok
    for old in ("2.8.0", "2.8.9+cu128", "2.5.1+cu124", "1.13.1"):
        message = dependencies.torch_too_old_message(old)
        assert message and f"torch>={FLOOR}" in message and old in message and "\n" not in message


@pytest.mark.unit
def test_the_floor_is_the_same_in_pyproject_the_dependency_check_the_image_and_the_readme():
    pyproject = (REPO / "pyproject.toml").read_text()
    assert f'"torch>={FLOOR}"' in pyproject
    assert dependencies.PACKAGES["torch"] == f"torch>={FLOOR}"
    base = re.search(r"^ARG BASE_IMAGE=\S+:(\d+\.\d+\.\d+)-", (REPO / "launch" / "Dockerfile").read_text(), re.M)
    assert base and dependencies.release(base[1]) >= dependencies.TORCH_FLOOR, base
    readme = (REPO / "README.md").read_text()
    assert f"torch>={FLOOR}" in readme and "torch>=2.4" not in readme
    assert base[0].split("=", 1)[1] in readme  # the README names the image the Dockerfile uses


@pytest.mark.unit
def test_the_image_tests_its_own_torch():
    """The image keeps its base's torch (2.9 in the default AWS image), not the one the suite
    runs on elsewhere: its `test` target runs the unit and dist tiers on that torch, with the
    tests and docs in the build context; the default target (the last stage) is the image."""
    dockerfile = (REPO / "launch" / "Dockerfile").read_text()
    stages = re.findall(r"^FROM (.+)$", dockerfile, re.M)
    assert stages[0] == "${BASE_IMAGE} AS image" and "image AS test" in stages and stages[-1] == "image", stages
    test_stage = dockerfile[dockerfile.index("FROM image AS test"):]
    assert 'pytest -m "unit or dist"' in test_stage and "-c /tmp/keep.txt" in test_stage, test_stage
    ignored = [line for line in (REPO / ".dockerignore").read_text().splitlines() if not line.startswith("#")]
    assert not {"tests", "docs", "benchmarks"} & set(ignored) and "!data/README.md" in ignored, ignored


@pytest.mark.unit
def test_the_installed_torch_has_the_apis_the_floor_stands_for():
    """What tests/setup.sh installs has them (what 2.8 lacks: DefaultStager, StagingOptions)."""
    from torch.distributed import broadcast_object_list
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions  # 2.9
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard  # public since 2.6

    assert {"use_pinned_memory", "use_shared_memory", "use_async_staging", "use_non_blocking_copy"} <= set(
        inspect.signature(StagingOptions).parameters)
    assert "group_src" in inspect.signature(broadcast_object_list).parameters  # 2.6
    assert callable(DefaultStager) and callable(fully_shard) and callable(MixedPrecisionPolicy)


# ---- an older torch: one line, before anything runs --------------------------------------------
def python_with_torch(root: Path, version: str) -> Path:
    """This venv's packages but not this one (a checkout run without pip), and in place of torch
    a stand-in that only has a version: anything that imports more of it fails loudly."""
    from test_launch import venv_without_package

    python = venv_without_package(root / "env", leave_out=("torch",))
    fake = root / "env" / "shelf" / "torch"
    fake.mkdir()
    (fake / "__init__.py").write_text(f"__version__ = {version!r}\n")
    return python


@pytest.mark.cli
@pytest.mark.parametrize("command", [[MAIN, "trainer.max_steps=1"], ["-m", "mingpt_ddp.bench", "peak"],
                                     ["-m", "mingpt_ddp.sample", "outputs/none"]])
def test_an_older_torch_is_one_line_naming_the_torch_needed(tmp_path, command):
    from test_launch import clean_env

    python = python_with_torch(tmp_path, "2.5.1+cu124")
    started = time.monotonic()
    proc = subprocess.run([str(python), *command], cwd=REPO if command[0] == "-m" else tmp_path,
                          capture_output=True, text=True, timeout=120, env=clean_env())
    text = output(proc)
    assert proc.returncode == 2, text
    assert text.strip().count("\n") == 0 and text.startswith("error: "), text  # one line, no traceback
    assert "torch 2.5.1+cu124" in text and f"'torch>={FLOOR}'" in text, text
    assert time.monotonic() - started < 60
    assert not (tmp_path / "outputs").exists()  # nothing ran: not even Hydra's run directory


@pytest.mark.cli
def test_the_floor_itself_passes_the_gate(tmp_path):
    from test_launch import clean_env

    python = python_with_torch(tmp_path, f"{FLOOR}.0a0+gitdeadbee")  # NVIDIA's build of the floor's branch
    proc = subprocess.run([str(python), "-c", "import mingpt_ddp; print('imported')"], cwd=REPO,
                          capture_output=True, text=True, timeout=120, env=clean_env())
    assert proc.returncode == 0 and proc.stdout.strip() == "imported", output(proc)


# ---- private torch APIs: a fallback, checked against torch's own -----------------------------
@pytest.mark.unit
def test_dcp_metadata_file_name_matches_torchs_private_helper(tmp_path):
    """sharded_snapshot reads DCP's index by name; torch's private _get_metadata_path is the
    reference. If torch drops or renames it, this fails: check metadata_file_name then."""
    from torch.distributed.checkpoint import FileSystemReader

    from mingpt_ddp.checkpoint.sharded_snapshot import metadata_file_name

    reader = FileSystemReader(str(tmp_path))
    assert hasattr(reader, "_get_metadata_path"), "torch removed FileSystemReader._get_metadata_path"
    for rank in (None, 0, 3):
        assert Path(reader._get_metadata_path(rank)).name == metadata_file_name(rank)


@pytest.mark.unit
def test_dcp_fsspec_reader_and_writer_are_where_sharded_snapshots_import_them():
    """Public classes in a private module: without them only local snapshot paths work."""
    from mingpt_ddp.checkpoint import sharded_snapshot

    assert sharded_snapshot.HAS_FSSPEC_DCP, "torch moved FsspecReader/FsspecWriter: object-store snapshots are refused"
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

    writer = sharded_snapshot._HashingWriter("memory://probe", sync_files=False)
    assert isinstance(writer, FsspecWriter)
    assert isinstance(writer.fs, sharded_snapshot._HashingFileSystem), "DCP's writer has no `fs`: shards are read back"


@pytest.mark.unit
def test_sharded_snapshots_use_no_private_dcp_module_but_the_fsspec_one():
    source = (REPO / "mingpt_ddp" / "checkpoint" / "sharded_snapshot.py").read_text()
    private = set(re.findall(r"torch\.distributed\.checkpoint\.(_\w+)", source))
    assert private <= {"_fsspec_filesystem"}, private
    assert not re.search(r"import[^\n]*\b_(EmptyStateDictLoadPlanner|load_state_dict|traverse)\b", source)


class RunsCode:
    """Pickles as a call to print; staged for saving as itself (not deep-copied through it)."""
    proof: Path

    def __reduce__(self):
        return (print, (f"ran code from a snapshot: {RunsCode.proof}",))

    def __deepcopy__(self, memo):
        return self


@pytest.mark.unit
def test_optimizer_entries_that_are_not_plain_data_are_refused(tmp_path, capsys):
    """DCP unpickles non-tensor entries with plain pickle; they must pass weights_only first."""
    from mingpt_ddp.errors import ConfigError
    from mingpt_ddp.checkpoint.sharded_snapshot import ShardedSnapshotStore

    RunsCode.proof = tmp_path / "pwned"
    store = ShardedSnapshotStore(str(tmp_path / "snapshot.pt"))
    crafted = {"model": {"w": torch.ones(2)}, "optimizer": {"param_groups": [{"lr": RunsCode()}]}}
    assert store.save(1, crafted, {}) is None
    capsys.readouterr()
    with pytest.raises(ConfigError, match="cannot load sharded snapshot"):
        store.load_latest({"model": {"w": torch.zeros(2)}, "optimizer": {"param_groups": [{"lr": 0.0}]}})
    assert "ran code" not in capsys.readouterr().out
    plain = {"model": {"w": torch.ones(2)}, "optimizer": {"param_groups": [{"lr": 0.5, "betas": (0.9, 0.95)}]}}
    assert store.save(2, plain, {}) is None
    target = {"model": {"w": torch.zeros(2)}, "optimizer": {"param_groups": [{"lr": 0.0, "betas": (0.0, 0.0)}]}}
    store.load_latest(target)
    assert target["optimizer"]["param_groups"] == [{"lr": 0.5, "betas": (0.9, 0.95)}]


@pytest.mark.unit
def test_private_torch_names_with_a_fallback_are_still_there():
    """Each is used behind a fallback (getattr / ImportError); a torch that drops one degrades
    quietly there, so it is checked here."""
    assert callable(getattr(torch.cpu, "_is_amx_tile_supported", None))  # precision.py, bench.py
    assert callable(getattr(torch.cpu, "_is_avx512_bf16_supported", None))  # bench.py
    from torch._inductor.async_compile import AsyncCompile, maybe_warm_pool  # preemption.py

    assert callable(maybe_warm_pool) and callable(AsyncCompile.warm_pool)


@pytest.mark.unit
def test_dcp_metadata_pickles_only_names_the_safe_unpickler_knows(tmp_path):
    """The restricted unpickler allows DCP's own private types by name (_StorageInfo,
    _MEM_FORMAT_ENCODING): a save and load round trip proves the names still match."""
    from mingpt_ddp.checkpoint.sharded_snapshot import ShardedSnapshotStore, _MetadataUnpickler

    store = ShardedSnapshotStore(str(tmp_path / "snapshot.pt"))
    assert store.save(3, {"model": {"w": torch.arange(4.0)}, "optimizer": {"param_groups": [{"lr": 1.0}]}}, {}) is None
    (directory,) = (tmp_path / "snapshot.pt.dcp").iterdir()
    with open(directory / ".metadata", "rb") as f:
        metadata = _MetadataUnpickler(f).load()
    assert "model.w" in metadata.state_dict_metadata
    with pytest.raises(pickle.UnpicklingError):
        _MetadataUnpickler(__import__("io").BytesIO(pickle.dumps(RunsCode()))).load()
