"""Shared fixtures: a per-session shm directory, session-scoped clusters, leak checks.

JAX runs on 8 CPU devices. Every arena of the suite lives in one shm directory of its own, so
the final check (no arena file, no sidecar process left) is exact. `make test` runs the suite
in two pytest-xdist workers, each a whole pytest session with its own shm directory, clusters
and leak check; files are handed out whole (see `pytest_xdist_make_scheduler`).
"""

from __future__ import annotations

import atexit
import contextlib
import glob
import os
import shutil
import tempfile
from typing import Any

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
os.environ["JAX_PLATFORMS"] = "cpu"

import psutil  # noqa: E402
import pytest  # noqa: E402
from helpers import kill_if_stopped  # noqa: E402
from slurm_helpers import LiveSlurm, slurm_missing  # noqa: E402

_base = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
SHM_DIR = tempfile.mkdtemp(prefix=f"colocar-test-{os.getpid()}-", dir=_base)
os.environ["COLOCAR_SHM_DIR"] = SHM_DIR
atexit.register(shutil.rmtree, SHM_DIR, True)  # also when pytest stops before the session ends
STATE_DIR = tempfile.mkdtemp(prefix="colocar-test-state-")  # named local sessions' records
os.environ["COLOCAR_STATE_DIR"] = STATE_DIR
atexit.register(shutil.rmtree, STATE_DIR, True)
SLURM_FILES = "tests/test_slurm_"  # one live Slurm serves them all: one worker runs them, first

MiB = 1 << 20
TEST_ARENA = 64 * MiB
# Fixtures shared by several test files live in plugin modules next to this file.
pytest_plugins = ["security_fixtures", "loader_config_fixtures"]
SLURMS: list[LiveSlurm] = []  # every live Slurm the session started, for the leak check


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--slow", action="store_true", help="run the long, seeded kill tests too")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    items.sort(key=lambda item: not item.nodeid.startswith(SLURM_FILES))  # stable: the longest
    # group of files goes out first, so that no worker is left with it at the end
    if config.getoption("--slow"):
        return
    skip = pytest.mark.skip(reason="needs --slow")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """Under pytest-xdist: a worker takes a whole file at a time (its module fixtures are set
    up once), and every Slurm file goes to the same worker. Two live Slurms at once would
    number their jobs alike, and jobs name their sidecars' arenas and ports after their ids."""
    from xdist.scheduler import LoadFileScheduling

    class FileScheduling(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return SLURM_FILES if nodeid.startswith(SLURM_FILES) else super()._split_scope(nodeid)

    return FileScheduling(config, log)


def server_children() -> list[psutil.Process]:
    """Sidecar (pool agent, fake GCS server) processes started by this test process that still run."""
    found = []
    for child in psutil.Process().children(recursive=True):
        try:
            command = " ".join(child.cmdline())
            server = any(name in command for name in ("colocar.sidecar", "colocar.pool", "fake-gcs-server"))
            if server and child.status() != psutil.STATUS_ZOMBIE:
                found.append(child)
        except psutil.Error:
            pass
    return found


@pytest.fixture(scope="session")
def shm_dir() -> str:
    return SHM_DIR


@pytest.fixture(scope="session")
def _shm_cluster():
    import colocar

    with colocar.local_cluster(hosts=2, arena_size=TEST_ARENA, lease_seconds=5, heartbeat_seconds=0.5) as c:
        yield c


@pytest.fixture(scope="session")
def _grpc_cluster():
    import colocar

    with colocar.local_cluster(
        hosts=2, arena_size=TEST_ARENA, shm=False, lease_seconds=5, heartbeat_seconds=0.5
    ) as c:
        yield c


@pytest.fixture
def cluster(_shm_cluster):
    """Two sidecars shared by every test that does not break them (array calls go to them)."""
    return _shm_cluster.make_current()


@pytest.fixture
def grpc_cluster(_grpc_cluster):
    """Two sidecars reached without shared memory: bulk data goes through chunked gRPC streams."""
    return _grpc_cluster.make_current()


@pytest.fixture
def make_cluster():
    """Starts small private clusters; stops them (even stopped or killed ones) at teardown."""
    import colocar

    made: list[Any] = []

    def make(**kwargs: Any) -> Any:
        options: dict[str, Any] = dict(
            hosts=1, arena_size=16 * MiB, lease_seconds=2, heartbeat_seconds=0.5, processes=1
        )
        options.update(kwargs)
        c = colocar.local_cluster(**options)
        made.append(c)
        return c

    yield make
    for c in made:
        for process in c.processes:
            kill_if_stopped(process)
        c.shutdown()  # persist=True sidecars too (they outlive close()), and their work folder


@pytest.fixture(scope="session")
def gcs_server(tmp_path_factory):
    """A fake GCS server for the session; the controller's environment points at it."""
    from colocar.demo.gcs import FakeGcs  # the demo's starter: the same server, the same way

    server = FakeGcs(str(tmp_path_factory.mktemp("gcs")))
    server.start()
    try:
        with server.environment():
            yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def slurm(tmp_path_factory):
    """A live Slurm for the session: munged, slurmctld and four slurmd (node1..node4) on this host."""
    reason = slurm_missing()
    if reason:
        pytest.skip(reason)
    cluster = LiveSlurm(tmp_path_factory.mktemp("slurm"))
    SLURMS.append(cluster)
    with cluster:
        yield cluster


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """The suite fails if it leaves a sidecar, Slurm or munge process or an arena file behind."""
    left = server_children()
    for process in left:
        process.kill()
    slurm_left = [process for cluster in SLURMS for process in cluster.leftover_processes()]
    for process in slurm_left:
        with contextlib.suppress(psutil.Error):
            process.kill()
    files = os.listdir(SHM_DIR) if os.path.isdir(SHM_DIR) else []
    if SLURMS:  # the arenas of Slurm jobs' sidecars (another xdist worker's are its own to check)
        files += glob.glob("/dev/shm/colocar-slurm*")
    shutil.rmtree(SHM_DIR, ignore_errors=True)
    problems = []
    if left:
        problems.append(f"sidecar or server processes left running: {[p.pid for p in left]}")
    if slurm_left:
        problems.append(f"Slurm or munge processes left running: {[p.pid for p in slurm_left]}")
    if files:
        problems.append(f"arena files left in the shm dirs: {files}")
    if problems:
        print("\nLEAK CHECK FAILED: " + "; ".join(problems))
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
