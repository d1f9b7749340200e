"""The READMEs' shell and Python blocks run as pasted, so the docs cannot drift from the code.

Every ```bash/sh/shell/python block of README.md and k8s/README.md carries a marker right above
it (tests/docs_blocks_helpers.py has the syntax): `run` blocks run here, `skip (why)` ones say
why they cannot (a real cluster, docker, PyPI); a block without a marker fails the suite.
Each unit runs in a fresh directory holding a copy of examples/, with this checkout's `colocar`
and Python first on PATH, JAX on 8 CPU devices, and google-cloud-storage and tensorstore
pointed at the suite's fake GCS server, which holds the README's bucket `my-bucket`. Paths
under /tmp and /dev/shm are moved into the test's own directories.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import yaml
from docs_blocks_helpers import PRELUDES, REPO, Block, all_blocks, blocks, units
from k8s_helpers import load_jobset_schema, validate_manifests

BUCKET = "my-bucket"  # the README's placeholder bucket, a real bucket on the fake server
UNITS = units()


@pytest.fixture(scope="module")
def docs_env(gcs_server, shm_dir: str) -> dict[str, str]:
    """The environment of every block: this checkout, 8 CPU devices, the fake GCS server."""
    gcs_server.create_bucket(BUCKET)
    bin_dir = os.path.dirname(sys.executable)
    return {
        **os.environ,
        **gcs_server.env,
        "PATH": bin_dir + os.pathsep + os.environ["PATH"],
        "PYTHONPATH": str(REPO),
        "XLA_FLAGS": "--xla_force_host_platform_device_count=8",
        "JAX_PLATFORMS": "cpu",
    }


def test_every_block_has_a_marker() -> None:
    found = all_blocks()
    assert len(found) >= 15 and UNITS
    problems = [f"{b.doc}:{b.line}: {b.problem}" for b in found if b.marker is None]
    assert problems == [], "\n".join(problems)


def test_markers_are_checked() -> None:
    """The check above can fail: no marker, a skip without a reason, an unknown option."""
    text = "\n".join(
        [
            "```sh\necho a\n```",
            "<!-- docs-test: skip -->\n```python\nx = 1\n```",
            "<!-- other comment -->\n<!-- docs-test: run bogus -->\n```bash\necho b\n```",
            "<!-- docs-test: run group=g 16G=>64M -->\n<!-- other comment -->\n```shell\necho c\n```",
            "```dockerfile\nFROM x\n```",
        ]
    )
    found = blocks(text, "t.md")
    assert [b.language for b in found] == ["sh", "python", "sh", "sh"]
    problems = [b.problem for b in found]
    assert "marker" in problems[0] and "reason" in problems[1] and "bogus" in problems[2], problems
    marker = found[3].marker
    assert marker is not None and (marker.group, marker.subs) == ("g", [("16G", "64M")])


def _substituted(code: str, block: Block, work: Path, shm: Path) -> str:
    """`code` (of `block`, with its neighbours of a run) with the marker's substitutions made and
    /tmp and /dev/shm moved into the test's directories."""
    assert block.marker is not None
    for old, new in block.marker.subs:
        assert old in code, f"{block.doc}:{block.line}: {old!r} is not in the block"
        code = code.replace(old, new)
    return code.replace("/tmp/", f"{work}/tmp/").replace("/dev/shm", str(shm))


def _run_python(code: str, env: dict[str, str], work: Path) -> None:
    (work / "docs_block.py").write_text(code)
    result = subprocess.run(
        [sys.executable, "docs_block.py"], cwd=work, env=env, capture_output=True, text=True, timeout=240
    )
    assert result.returncode == 0, f"{code}\n--- stdout\n{result.stdout}\n--- stderr\n{result.stderr}"


def _without_emulator(code: str, url: str, env: dict[str, str]) -> tuple[str, dict[str, str]]:
    """The block with `url` standing for the fake GCS server, and an environment without the
    variables that point at it: the block must set them all itself."""
    server = env["STORAGE_EMULATOR_HOST"]
    kept = {k: v for k, v in env.items() if k not in ("STORAGE_EMULATOR_HOST", "TENSORSTORE_GCS_HTTP_URL")}
    kept.pop("GOOGLE_AUTH_TOKEN_FOR_TESTING", None)
    return code.replace(url, server), kept


def _run_shell(code: str, env: dict[str, str], work: Path) -> None:
    result = subprocess.run(
        ["bash", "-e", "-o", "pipefail", "-c", code],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert result.returncode == 0, f"{code}\n--- stdout\n{result.stdout}\n--- stderr\n{result.stderr}"


def _serve(code: str, env: dict[str, str], work: Path) -> None:
    """A server block: started, stopped with SIGTERM once ready; it must drain and exit 0."""
    ready = Path(code.split("--ready-file", 1)[1].split()[0])
    process = subprocess.Popen(
        ["bash", "-e", "-o", "pipefail", "-c", code],
        cwd=work,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 120
        while not (ready.exists() and ready.read_text().strip()):
            assert process.poll() is None, process.communicate()
            assert time.monotonic() < deadline, f"no {ready} within 120 s"
            time.sleep(0.1)
        os.kill(json.loads(ready.read_text())["pid"], signal.SIGTERM)
        out, err = process.communicate(timeout=60)
        assert process.returncode == 0, f"{code}\n--- stdout\n{out}\n--- stderr\n{err}"
        assert "drained" in err, err
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def _check_k8s(work: Path, before: set[Path]) -> None:
    """Every YAML file the block wrote validates; one that is also in the repository is equal."""
    written = sorted(set(work.rglob("*.yaml")) - before)
    assert written, "the block wrote no YAML file"
    schema = load_jobset_schema()
    for path in written:
        objects = list(yaml.safe_load_all(path.read_text()))
        assert [o["kind"] for o in objects][-1] == "JobSet", path
        validate_manifests(objects, schema)
        twin = REPO / path.relative_to(work)
        if twin.exists():
            assert path.read_text() == twin.read_text(), f"{twin} differs from its rendering"


def _runs(unit: list[Block], work: Path, shm: Path) -> list[tuple[Block, str]]:
    """What to run, in order: (first block, code), each block's code substituted, consecutive
    Python blocks joined into one program, the group's prelude and teardown around its first."""
    runs: list[tuple[Block, str]] = []
    for i, block in enumerate(unit):
        code = _substituted(block.code, block, work, shm)
        if block.language == "python" and i and unit[i - 1].language == "python":
            runs[-1] = (runs[-1][0], runs[-1][1] + code)
        else:
            runs.append((block, code))
    prelude = next((b.marker.prelude for b in unit if b.marker and b.marker.prelude), "")
    if prelude:
        setup, teardown = PRELUDES[prelude]
        i = next(i for i, (block, _) in enumerate(runs) if block.language == "python")
        runs[i] = (runs[i][0], setup + runs[i][1] + teardown)
    return runs


@pytest.mark.parametrize("key", sorted(UNITS))
def test_block_runs(key: str, docs_env: dict[str, str], tmp_path: Path, shm_dir: str) -> None:
    unit = UNITS[key]
    work = tmp_path / "work"
    ignore = shutil.ignore_patterns("data", "__pycache__")
    shutil.copytree(REPO / "examples", work / "examples", ignore=ignore)
    (work / "tmp").mkdir()
    shm = Path(tempfile.mkdtemp(dir=shm_dir, prefix="docs-"))
    env = {**docs_env, "COLOCAR_SHM_DIR": str(shm)}
    try:
        for block, code in _runs(unit, work, shm):
            assert block.marker is not None
            before = set(work.rglob("*.yaml"))
            if block.language == "python":
                _run_python(code, env, work)
            elif block.marker.serve:
                _serve(code, env, work)
            elif block.marker.emulator:
                _run_shell(*_without_emulator(code, block.marker.emulator, env), work=work)
            else:
                _run_shell(code, env, work)
            if block.marker.check == "k8s":
                _check_k8s(work, before)
        assert os.listdir(shm) == [], "a block left shared memory behind"
    finally:
        shutil.rmtree(shm, ignore_errors=True)
