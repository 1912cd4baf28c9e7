"""Corpora as Parquet and JSON-lines shards: read streaming, document by document, from a
path or any fsspec URL; a bad or missing column is one error naming the file."""
import gzip
import json

import fsspec
import pytest

from mingpt_ddp.corpus import documents
from mingpt_ddp.errors import ConfigError

pytestmark = pytest.mark.unit

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

DOCS = [f"document {i}: naïve café ☃\nsecond line {i}" for i in range(50)]


def write_parquet(path, texts, column="text", row_group_size=7, **extra):
    table = pa.table({"id": list(range(len(texts))), column: texts, **extra})
    pq.write_table(table, path, row_group_size=row_group_size)
    return path


def write_jsonl(path, records):
    data = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records).encode()
    if str(path).endswith(".gz"):
        data = gzip.compress(data)
    path.write_bytes(data)
    return path


def test_formats_come_from_the_file_names():
    assert [documents.file_format(n) for n in ("a.parquet", "s3://b/x.PARQUET", "a.jsonl", "a.jsonl.gz",
                                                 "a.txt", "a.json", "a.gz", "s3://b/k.jsonl?X-Amz-Signature=s")] == \
        ["parquet", "parquet", "jsonl", "jsonl", "text", "jsonl", "text", "jsonl"]


def test_parquet_is_read_row_group_by_row_group(tmp_path, monkeypatch):
    path = write_parquet(tmp_path / "shard.parquet", DOCS[:20] + [None, ""] + DOCS[20:])
    assert pq.ParquetFile(path).num_row_groups == 8
    read = []
    original = pq.ParquetFile.read_row_group

    def spy(self, i, *args, **kwargs):
        read.append((i, kwargs.get("columns")))
        return original(self, i, *args, **kwargs)

    monkeypatch.setattr(pq.ParquetFile, "read_row_group", spy)
    docs = documents.read_documents(str(path))
    assert next(docs) == DOCS[0] and read == [(0, ["text"])]  # one row group read so far, the text column only
    assert [DOCS[0], *docs] == DOCS  # null and empty values are not documents
    assert [i for i, _ in read] == list(range(8))


def test_parquet_text_column_and_dictionary_encoded_strings(tmp_path):
    path = tmp_path / "d.parquet"
    table = pa.table({"content": pa.array(DOCS).dictionary_encode()})
    pq.write_table(table, path, row_group_size=10)
    assert list(documents.read_documents(str(path), text_column="content")) == DOCS


def test_parquet_without_the_column_names_the_file_and_its_columns(tmp_path):
    path = write_parquet(tmp_path / "shard-3.parquet", DOCS, column="content")
    with pytest.raises(ConfigError) as err:
        list(documents.read_documents(str(path), "text"))
    message = str(err.value)
    assert "shard-3.parquet" in message and "no column 'text'" in message and "id, content" in message
    assert "data.text_column" in message and "\n" not in message


def test_parquet_column_that_is_not_text(tmp_path):
    path = write_parquet(tmp_path / "n.parquet", DOCS, score=[1.5] * len(DOCS))
    with pytest.raises(ConfigError, match=r"n.parquet: column 'score' holds double, not text"):
        list(documents.read_documents(str(path), "score"))


def test_a_file_that_is_not_parquet(tmp_path):
    (tmp_path / "broken.parquet").write_bytes(b"not parquet at all")
    with pytest.raises(ConfigError, match="broken.parquet is not a readable Parquet file"):
        list(documents.read_documents(str(tmp_path / "broken.parquet")))


@pytest.mark.parametrize("name", ["shard.jsonl", "shard.jsonl.gz"])
def test_json_lines_plain_and_gzipped(tmp_path, name):
    records = [{"text": d, "url": f"https://example.org/{i}"} for i, d in enumerate(DOCS)]
    records[3:3] = [{"text": None}, {"text": ""}]
    path = write_jsonl(tmp_path / name, records)
    path.write_bytes(path.read_bytes() + (b"" if name.endswith(".gz") else b"\n  \n"))  # blank lines are skipped
    assert list(documents.read_documents(str(path))) == DOCS


@pytest.mark.parametrize("line, expected", [
    ('{"body": "x"}', r"shard.jsonl, line 3: no field 'text' \(it has: body\)"),
    ('["x"]', r"shard.jsonl, line 3: no field 'text' \(it has: list\)"),
    ('{"text": 5}', r"shard.jsonl, line 3: field 'text' is a int, not text"),
    ('{"text": "x"', r"shard.jsonl, line 3: not a JSON object"),
])
def test_json_lines_with_a_bad_line_name_the_file_and_line(tmp_path, line, expected):
    path = tmp_path / "shard.jsonl"
    path.write_text('{"text": "a"}\n{"text": "b"}\n' + line + "\n", encoding="utf-8")
    with pytest.raises(ConfigError, match=expected) as err:
        list(documents.read_documents(str(path)))
    assert "\n" not in str(err.value)


def test_a_truncated_gzip_file(tmp_path):
    path = write_jsonl(tmp_path / "cut.jsonl.gz", [{"text": d} for d in DOCS * 20])
    path.write_bytes(path.read_bytes()[:-40])
    with pytest.raises(ConfigError, match="cut.jsonl.gz is not a complete gzip file"):
        list(documents.read_documents(str(path)))


def test_shards_are_read_through_fsspec_urls(tmp_path):
    """Not only local paths: any filesystem fsspec opens (S3 in production; memory:// here)."""
    fs = fsspec.filesystem("memory")
    local = write_parquet(tmp_path / "a.parquet", DOCS)
    fs.pipe("/corpus/a.parquet", local.read_bytes())
    fs.pipe("/corpus/b.jsonl.gz", gzip.compress("".join(json.dumps({"text": d}) + "\n" for d in DOCS).encode()))
    assert list(documents.read_documents("memory://corpus/a.parquet", storage_options={})) == DOCS
    assert list(documents.read_documents("memory://corpus/b.jsonl.gz")) == DOCS
    with pytest.raises(ConfigError, match="memory://corpus/a.parquet has no column 'body'"):
        list(documents.read_documents("memory://corpus/a.parquet", "body"))


def test_without_pyarrow_the_error_names_the_extra(monkeypatch, tmp_path):
    import builtins

    real_import = builtins.__import__

    def no_pyarrow(name, *args, **kwargs):
        if name.startswith("pyarrow"):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_pyarrow)
    with pytest.raises(ConfigError, match=r"pip install 'mingpt-ddp\[parquet\]'"):
        list(documents.read_documents(str(tmp_path / "x.parquet")))


@pytest.mark.parametrize("name", ["c.json", "c.json.gz"])
def test_json_lines_named_json_are_read_as_json_lines(tmp_path, name):
    import gzip
    path = tmp_path / name
    data = b'{"text": "first"}\n{"text": "second"}\n'
    (gzip.open if name.endswith(".gz") else open)(path, "wb").write(data)
    assert documents.file_format(str(path)) == documents.JSONL
    assert list(documents.read_documents(str(path))) == ["first", "second"]


def test_parquet_string_view_column(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    if not hasattr(pa, "string_view"):
        pytest.skip("this pyarrow has no string_view")
    path = tmp_path / "v.parquet"
    pq.write_table(pa.table({"text": pa.array(["a b", "c d"], type=pa.string_view())}), path)
    assert list(documents.read_documents(str(path))) == ["a b", "c d"]
