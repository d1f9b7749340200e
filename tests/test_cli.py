"""The `colocar` commands as a user meets them: run as processes, a mistake is one clear line.

Each test runs `python -m colocar ...` (or `python -m colocar.sidecar`) and checks the exit
status, that stderr holds no traceback, and that the message names what to fix. Also: the one
size syntax of every flag, `--version`, and defaults in every `--help`.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from colocar.k8s.options import RenderError
from colocar.k8s.options import parse_size as k8s_size
from colocar.sizes import parse_size

ROOT = Path(__file__).resolve().parent.parent
GiB = 1 << 30


def colocar(
    *args: str, env: dict[str, str] | None = None, module: str = "colocar"
) -> subprocess.CompletedProcess:
    """Runs `python -m MODULE ARGS` with this checkout first on the path (deadline: 120 s)."""
    full_env = {**os.environ, **(env or {}), "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-m", module, *args], capture_output=True, text=True, env=full_env, timeout=120
    )


def assert_user_error(result: subprocess.CompletedProcess, *words: str) -> None:
    assert result.returncode not in (0, None), result
    assert "Traceback" not in result.stderr, result.stderr
    for word in words:
        assert word in result.stderr, result.stderr


def test_ckpt_ls_of_a_missing_path_says_so_and_fails(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-dir"
    result = colocar("ckpt", "ls", str(missing))
    assert_user_error(result, str(missing), "does not exist")
    assert "step(s)" not in result.stdout
    empty = tmp_path / "empty"  # an existing, empty directory is a checkpoint with no step yet
    empty.mkdir()
    ok = colocar("ckpt", "ls", str(empty))
    assert ok.returncode == 0 and "0 step(s)" in ok.stdout, ok


def test_ckpt_show_of_a_missing_path_says_so(tmp_path: Path) -> None:
    assert_user_error(colocar("ckpt", "show", str(tmp_path / "nope"), "3"), "does not exist")


def test_ckpt_ls_of_a_missing_bucket_names_it(gcs_server) -> None:
    result = colocar("ckpt", "ls", "gs://no-such-bucket-x/runs", env=gcs_server.env)
    assert_user_error(result, "bucket 'no-such-bucket-x' does not exist")
    gcs_server.create_bucket("cli-empty-bucket")
    result = colocar("ckpt", "ls", "gs://cli-empty-bucket/runs", env=gcs_server.env)
    assert_user_error(result, "gs://cli-empty-bucket/runs does not exist")


def _dead_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_ckpt_ls_with_storage_down_gives_up_after_timeout() -> None:
    """A storage server that does not answer: `--timeout` bounds the retries, then one line."""
    url = f"http://127.0.0.1:{_dead_port()}"
    env = {"STORAGE_EMULATOR_HOST": url, "GOOGLE_AUTH_TOKEN_FOR_TESTING": "x"}
    result = colocar("ckpt", "ls", "gs://some-bucket/runs", "--timeout", "1", env=env)
    assert_user_error(result, "gs://some-bucket", "gave up after 1 s")


def test_sidecar_with_a_missing_token_file_says_which(tmp_path: Path) -> None:
    token = str(tmp_path / "token")
    for module, args in (("colocar", ["sidecar"]), ("colocar.sidecar", [])):
        result = colocar(*args, "--token-file", token, "--shm-dir", str(tmp_path), module=module)
        assert_user_error(result, "--token-file", token, "No such file")
    assert os.listdir(tmp_path) == []  # no arena was created


def test_sidecar_without_room_for_its_arena_says_why(tmp_path: Path) -> None:
    result = colocar("sidecar", "--shm-dir", str(tmp_path / "missing"), "--processes", "0")
    assert_user_error(result, "colocar sidecar: error: cannot create an arena file", "missing")


def test_k8s_render_upper_case_bucket_is_a_clear_error() -> None:
    base = ["k8s", "render", "--topology", "v5e-16", "--image", "img:1"]
    result = colocar(*base, "--bucket", "gs://BUCKET/runs")
    assert_user_error(result, "lower case", "gs://bucket/runs")
    assert result.stdout == ""
    dotted = colocar(*base, "--bucket", "gs://ckpt.example.com/runs", "--shm-size", "32G")
    assert dotted.returncode == 0 and "sizeLimit: 32Gi" in dotted.stdout, dotted.stderr


def test_examples_write_data_writes_what_the_example_transforms_read(tmp_path: Path) -> None:
    """`colocar examples write-data` writes records `examples/pipeline_transforms.py` decodes
    (some unlabelled, for the config's filter); bad counts are one line."""
    from array_record.python.array_record_module import ArrayRecordReader

    result = colocar("examples", "write-data", str(tmp_path / "data"), "--records", "40", "--shards", "2")
    assert result.returncode == 0 and "wrote 40 records to 2 files" in result.stderr, result
    names = sorted(os.listdir(tmp_path / "data"))
    assert names == ["train-00000.array_record", "train-00001.array_record"]
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        import pipeline_transforms as transforms
    finally:
        sys.path.remove(str(ROOT / "examples"))
    records = []
    for name in names:
        reader = ArrayRecordReader(str(tmp_path / "data" / name))
        records += [transforms.decode(r) for r in reader.read_all()]
        reader.close()
    assert len(records) == 40 and records[0]["image"].shape == (224, 224, 3)
    assert [transforms.has_label(r) for r in records].count(False) == 2  # records 15 and 31
    assert_user_error(colocar("examples", "write-data", str(tmp_path / "x"), "--shards", "0"), "shards")


def test_version_and_unknown_command() -> None:
    result = colocar("--version")
    assert result.returncode == 0 and result.stdout.startswith("colocar ")
    assert_user_error(colocar("frobnicate"), "unknown command")


@pytest.mark.parametrize(
    "args,default",
    [
        (["sidecar", "--help"], "(default: 127.0.0.1:0)"),
        (["ckpt", "ls", "--help"], "(default: 30.0)"),
        (["k8s", "render", "--help"], "(default: 7070)"),
        (["examples", "write-data", "--help"], "(default: 256)"),
    ],
)
def test_help_shows_defaults(args: list[str], default: str) -> None:
    result = colocar(*args)
    assert result.returncode == 0 and default in " ".join(result.stdout.split()), result.stdout


@pytest.mark.parametrize(
    "text,nbytes",
    [("16G", 16 * GiB), ("16Gi", 16 * GiB), ("16GiB", 16 * GiB), ("512M", 512 << 20), ("4096", 4096)],
)
def test_one_size_syntax(text: str, nbytes: int) -> None:
    assert parse_size(text) == nbytes
    if nbytes % (1 << 20) == 0:
        assert k8s_size(text, "--shm-size") == nbytes  # the same text, the same bytes


@pytest.mark.parametrize("text", ["16X", "", "G", "-1G", "1.3"])
def test_bad_size_is_a_clear_error(text: str) -> None:
    with pytest.raises(ValueError, match="is not a"):
        parse_size(text)
    with pytest.raises(RenderError, match="--shm-size"):
        k8s_size(text, "--shm-size")


def test_sidecar_bad_size_flag_is_a_usage_error(tmp_path: Path) -> None:
    result = colocar("sidecar", "--arena-size", "16X", "--shm-dir", str(tmp_path))
    assert result.returncode == 2
    assert_user_error(result, "--arena-size", "'16X' is not a size")


def test_checkpoint_manager_on_a_missing_bucket_names_it(gcs_server, make_cluster) -> None:
    """Not the storage client's `NotFound 404` from the lease write: an error naming the bucket."""
    from colocar.checkpoint import CheckpointManager
    from colocar.checkpoint.store.storage import StorageError

    c = make_cluster()
    with pytest.raises(StorageError, match="bucket 'no-such-bucket-m' does not exist"):
        mngr = CheckpointManager("gs://no-such-bucket-m/run", c)
        mngr.save(1, {"a": 1})
        mngr.wait()
