"""Data sources: files, globs, folders, save_to_disk folders and datasets.Dataset objects; the
format detected from the columns; every record checked with where it is; pieces that cover it."""

from __future__ import annotations

import json

import pytest

from ray_trainer._data import records as records_module
from ray_trainer._data.records import scan
from ray_trainer._data.sources import DataFileError, read_piece, resolve

CHAT = {
    "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi?"},
        {"role": "assistant", "content": "Hello."},
    ]
}


def _jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _all(source):
    return [r for piece in source.pieces for _, r in read_piece(source, piece)]


@pytest.mark.parametrize(
    ("record", "fmt"),
    [
        (CHAT, "messages"),
        ({"prompt": "2+2=", "completion": "4"}, "prompt_completion"),
        ({"prompt": CHAT["messages"][:2], "completion": CHAT["messages"][2:]}, "conversational"),
        ({"text": "hello", "meta": 1}, "text"),
    ],
)
def test_the_format_comes_from_the_columns(tmp_path, record, fmt):
    source = resolve(str(_jsonl(tmp_path / "d.jsonl", [record] * 3)), "data")
    assert source.fmt == fmt


def test_columns_that_fit_no_format_are_listed_with_the_accepted_ones(tmp_path):
    path = _jsonl(tmp_path / "d.jsonl", [{"question": "q", "answer": "a"}])
    with pytest.raises(DataFileError) as info:
        resolve(str(path), "data")
    msg = str(info.value)
    assert "'question', 'answer'" in msg and '"messages"' in msg and '"prompt"' in msg
    assert "text_field" in msg


def test_parquet_json_arrays_globs_and_folders_are_read_in_order(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"text": f"line {i}"} for i in range(10)]
    folder = tmp_path / "parts"
    folder.mkdir()
    pq.write_table(pa.Table.from_pylist(rows[:4]), folder / "a.parquet", row_group_size=3)
    (folder / "b.json").write_text(json.dumps(rows[4:7]))  # a JSON array of records
    _jsonl(folder / "c.jsonl", rows[7:])
    (folder / "notes.txt").write_text("not data")
    for spec in (str(folder), str(folder / "*")):
        source = scan(resolve(spec, "data"))
        assert _all(source) == rows and source.records == 10
    assert scan(resolve(str(folder / "*.parquet"), "data")).records == 4
    with pytest.raises(DataFileError, match="matches no file"):
        resolve(str(folder / "*.csv"), "data")


def test_a_datasets_object_and_a_save_to_disk_folder(tmp_path):
    import datasets

    ds = datasets.Dataset.from_list([CHAT, {"messages": CHAT["messages"][1:]}] * 3)
    ds = ds.select([5, 0, 1])  # an indices mapping: the logical order is what counts
    for value in (ds, str(tmp_path / "saved")):
        if isinstance(value, str):
            ds.save_to_disk(value)
        source = scan(resolve(value, "data"))
        assert source.fmt == "messages" and source.records == 3
        got = _all(source)
        assert got[0] == {"messages": CHAT["messages"][1:]} and got[1] == CHAT  # nulls dropped
    with pytest.raises(DataFileError, match=r"pass one split, e.g. data=dataset\['train'\]"):
        resolve(datasets.DatasetDict({"train": ds}), "data")


def test_a_missing_path_names_the_field_and_where_it_looked(tmp_path):
    with pytest.raises(DataFileError, match=r"val_data: .*nope.jsonl does not exist"):
        resolve(str(tmp_path / "nope.jsonl"), "val_data")
    with pytest.raises(DataFileError, match=r"data: .* holds no data file \(nothing\)"):
        resolve(str(tmp_path), "data")  # a folder with no data file in it


@pytest.mark.parametrize(
    ("name", "content"), [("e.jsonl", ""), ("e.jsonl", "\n\n  \n"), ("e.json", "[ ]")]
)
def test_an_empty_file_is_refused_with_its_name(tmp_path, name, content):
    path = tmp_path / name
    path.write_text(content)
    with pytest.raises(DataFileError, match=rf"^data: {path} is empty \(no record in it\); write"):
        resolve(str(path), "data")


def test_every_bad_record_is_counted_and_the_first_named_with_its_line(tmp_path):
    path = tmp_path / "d.jsonl"
    lines = [json.dumps(CHAT), "{oops", json.dumps({"text": "x"}), json.dumps(CHAT)]
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(DataFileError) as info:
        scan(resolve(str(path), "data"))
    msg = str(info.value)
    assert msg.startswith(f"{path}:2: invalid JSON") and "1 more bad record" in msg
    assert f"{path}:3: 'messages' must be a non-empty list" in msg


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        ('{"body": "x"}', r"missing field 'text' \(found keys: 'body'\)"),
        ('{"prompt": "q"}', r"missing field 'completion' \(found keys: 'prompt'\)"),
        ("[1, 2]", "a record must be a JSON object, got a JSON array"),
        ('"just text"', "a record must be a JSON object, got a JSON string"),
        ('{"text": 3}', "field 'text' must be a string, got a JSON number"),
        (
            '{"prompt": "q", "completion": null}',
            "field 'completion' must be a string, got a JSON null",
        ),
    ],
)
def test_a_record_of_the_wrong_shape_is_named_by_its_line(tmp_path, line, expected):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"text": "ok"}) + "\n" + line + "\n")
    with pytest.raises(DataFileError, match=rf"d\.jsonl:2: {expected}"):
        scan(resolve(str(path), "data"))


def test_invalid_utf8_is_named_by_its_line(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_bytes(b'{"text": "ok"}\n{"text": "\xff"}\n')
    with pytest.raises(DataFileError, match=r"d\.jsonl:2: not valid UTF-8"):
        scan(resolve(str(path), "data"))


def test_a_bad_row_of_a_parquet_file_is_named_by_its_index(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [CHAT, CHAT, {"messages": [{"role": "user", "content": "only a question"}]}]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "d.parquet")
    with pytest.raises(DataFileError, match=r"d\.parquet\[2\]: .*assistant"):
        scan(resolve(str(tmp_path / "d.parquet"), "data"))


def test_pieces_cover_every_line_once_with_their_line_numbers(tmp_path, monkeypatch):
    monkeypatch.setattr(records_module, "PIECE_RECORDS", 4)
    records = [{"text": f"t{i}"} for i in range(11)]
    path = tmp_path / "d.jsonl"
    body = "\ufeff" + "".join(
        json.dumps(r) + "\n" + ("\n" if i == 5 else "") for i, r in enumerate(records)
    )
    path.write_text(body, encoding="utf-8")  # a byte-order mark and a blank line
    source = scan(resolve(str(path), "data"))
    assert [p.records for p in source.pieces] == [4, 4, 3]
    wheres = [w for p in source.pieces for w, _ in read_piece(source, p)]
    assert wheres[:6] == [f"{path}:{n}" for n in range(1, 7)] and wheres[6] == f"{path}:8"
    assert _all(source) == records


def test_text_and_prompt_completion_lines_mix_as_they_always_could(tmp_path):
    rows = [{"text": "a b"}, {"prompt": "q", "completion": "a"}, {"text": "c"}]
    source = scan(resolve(str(_jsonl(tmp_path / "d.jsonl", rows)), "data"))
    assert source.fmt == "text" and source.records == 3
