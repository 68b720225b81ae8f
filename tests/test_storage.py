"""lightray.storage on real files (and, where moto is installed, a real S3 API server on localhost)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from lightray import storage


def test_write_bytes_replaces_the_file_whole_and_leaves_no_temp(tmp_path):
    target = tmp_path / "sub" / "state.bin"  # the parent folder is created
    storage.write_bytes(str(target), b"old")
    storage.write_bytes(str(target), b"new contents")
    assert target.read_bytes() == b"new contents"
    assert sorted(p.name for p in target.parent.iterdir()) == ["state.bin"]


def test_a_write_cut_short_keeps_the_old_file(tmp_path):
    # A file-size limit makes the kernel stop the write after 64 kB, part way through the data: the state a
    # crash mid-write leaves on disk. The old file must still be there, whole, and no temp file left behind.
    target = tmp_path / "manifest.json"
    target.write_bytes(b"old")
    script = textwrap.dedent(f"""
        import resource, signal, sys
        from lightray import storage
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # fail the write with EFBIG rather than die
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 16, 1 << 16))
        try:
            storage.write_bytes({str(target)!r}, b"x" * (1 << 20))
        except OSError as exc:
            print("failed", exc.errno)
            sys.exit(0)
        print("written")
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("failed")
    assert target.read_bytes() == b"old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["manifest.json"]


def test_a_failed_rename_removes_the_temp_and_keeps_the_target(tmp_path):
    target = tmp_path / "report"
    target.mkdir()
    (target / "keep.txt").write_text("kept")
    with pytest.raises(OSError):
        storage.write_bytes(str(target), b"data")  # a file cannot replace a folder
    assert (target / "keep.txt").read_text() == "kept"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report"]


def test_join_list_exists_remove_on_local_paths(tmp_path):
    root = str(tmp_path)
    assert storage.join(root + "/", "/a/", "b.json") == f"{root}/a/b.json"
    storage.write_json(storage.join(root, "a", "b.json"), {"k": 1})
    storage.write_text(storage.join(root, "a", "c.txt"), "hello")
    storage.makedirs(storage.join(root, "a", "d", "e"))
    assert storage.list_dir(storage.join(root, "a")) == ["b.json", "c.txt", "d"]
    infos = storage.list_dir(storage.join(root, "a"), detail=True)
    assert [(i.base_name, i.type) for i in infos] == [("b.json", storage.FileType.File),
                                                     ("c.txt", storage.FileType.File),
                                                     ("d", storage.FileType.Directory)]
    assert storage.list_dir(storage.join(root, "missing")) == []
    assert storage.read_json(storage.join(root, "a", "b.json")) == {"k": 1}
    assert storage.read_text(storage.join(root, "a", "c.txt")) == "hello"
    assert storage.file_size(storage.join(root, "a", "c.txt")) == 5
    assert storage.file_size(storage.join(root, "a", "d")) is None
    assert storage.exists(storage.join(root, "a", "d", "e"))

    storage.remove(storage.join(root, "a", "c.txt"))
    assert not storage.exists(storage.join(root, "a", "c.txt"))
    storage.remove(storage.join(root, "a"))  # a whole tree
    assert not (tmp_path / "a").exists()
    storage.remove(storage.join(root, "a"))  # already gone: nothing to do
    with pytest.raises(FileNotFoundError):
        storage.remove(storage.join(root, "a"), missing_ok=False)


def test_read_bytes_from_an_offset_and_sha256_match_the_file(tmp_path):
    import hashlib

    p = tmp_path / "blob"
    data = bytes(range(256)) * 100
    p.write_bytes(data)
    assert storage.read_bytes(str(p), offset=1000) == data[1000:]
    assert storage.sha256(str(p)) == hashlib.sha256(data).hexdigest()
    fs, inner = storage.resolve_fs(str(p))
    assert storage.read_bytes(inner, fs=fs) == data


def test_read_jsonl_skips_a_half_written_last_line(tmp_path):
    p = tmp_path / "metrics.jsonl"
    p.write_text('{"step": 1}\n\n{"step": 2}\n{"step": 3, "lo')
    assert storage.read_jsonl(str(p)) == [{"step": 1}, {"step": 2}]
    records, notes = storage.parse_jsonl(p.read_text(), str(p))
    assert len(records) == 2 and "truncated last line" in notes[0]


def test_read_jsonl_rejects_a_bad_line_before_the_last(tmp_path):
    p = tmp_path / "metrics.jsonl"
    p.write_text('{"step": 1}\nnot json\n{"step": 2}\n')
    with pytest.raises(storage.JsonlError, match=r"metrics.jsonl:2: not a JSON object"):
        storage.read_jsonl(str(p))


def test_append_and_drop_partial_last_line(tmp_path):
    p = str(tmp_path / "metrics.jsonl")
    storage.append_text(p, json.dumps({"step": 1}) + "\n")
    storage.append_text(p, '{"step": 2, "cut')
    storage.drop_partial_last_line(p)
    storage.append_text(p, json.dumps({"step": 2}) + "\n")
    assert storage.read_jsonl(p) == [{"step": 1}, {"step": 2}]


def test_normalise_resolves_local_spellings(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert storage.normalise("x/../y") == str(tmp_path / "y")
    assert storage.normalise(f"file://{tmp_path}/z") == str(tmp_path / "z")
    assert storage.normalise("s3://bucket/prefix/") == "s3://bucket/prefix"


def _moto_server():
    try:
        from moto.server import ThreadedMotoServer
    except ImportError:
        return None
    return ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)


@pytest.fixture
def s3_root(monkeypatch):
    server = _moto_server()
    if server is None:
        pytest.skip("moto[server] is not installed")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    server.start()
    try:
        host, port = server.get_host_and_port()
        query = f"endpoint_override={host}:{port}&scheme=http&region=us-east-1"
        import pyarrow.fs as pafs

        pafs.S3FileSystem(endpoint_override=f"{host}:{port}", scheme="http", region="us-east-1",
                          allow_bucket_creation=True).create_dir("lightray-test")
        yield "s3://lightray-test/run", query
    finally:
        server.stop()


def test_round_trip_over_s3(s3_root):
    root, query = s3_root

    def uri(*parts: str) -> str:
        return storage.join(root, *parts) + "?" + query

    storage.write_json(uri("summary.json"), {"status": "finished"})
    storage.write_bytes(uri("checkpoint_000000000001", "state_rank0.pt"), b"\x00" * 1000)
    assert storage.read_json(uri("summary.json")) == {"status": "finished"}
    assert storage.exists(uri("summary.json"))
    assert storage.file_size(uri("checkpoint_000000000001", "state_rank0.pt")) == 1000
    assert storage.list_dir(uri()) == ["checkpoint_000000000001", "summary.json"]
    storage.remove(uri("checkpoint_000000000001"))
    assert storage.list_dir(uri()) == ["summary.json"]
