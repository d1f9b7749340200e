"""What tests/test_docs_blocks.py needs: the fenced shell and Python blocks of the READMEs and
the docs pages, their `<!-- docs-test: ... -->` markers, and the code the test wraps around
fragments (preludes).

A marker is an HTML comment among the comment lines right above a block's fence:

    <!-- docs-test: skip (why it cannot run in a test) -->
    <!-- docs-test: run [group=NAME] [prelude=NAME] [serve] [check=k8s] [emulator=URL] [OLD=>NEW ...] -->

`group`: blocks with the same group (on one page or across pages, in `DOCS` order) run in order
in one directory, consecutive
Python blocks as one program. `prelude`: test code run before the group's Python (and its
teardown after), defining what a fragment takes from its surroundings. `serve`: a shell block
that starts a server; it is stopped with SIGTERM once its `--ready-file` exists and must then
exit 0. `check=k8s`: every YAML file the block writes must hold valid Kubernetes objects.
`emulator=URL`: the block runs without the GCS emulator's variables (it must set them itself),
URL standing for the suite's fake GCS server.
`OLD=>NEW`: a substitution (no spaces), for sizes a test machine cannot hold.
"""

from __future__ import annotations

import re
import textwrap
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
def _docs() -> tuple[str, ...]:
    """The READMEs, then the site's pages in the order of its navigation (mkdocs.yml), so a
    group spanning pages (pipelines, then checkpoints) runs in the order a reader meets it."""
    import yaml

    pages: list[str] = []

    def walk(node: object) -> None:
        if isinstance(node, str):
            pages.append(f"docs/{node}")
        elif isinstance(node, list):
            for item in node:
                walk(item)
        elif isinstance(node, dict):
            for value in node.values():
                walk(value)

    walk(yaml.safe_load((REPO / "mkdocs.yml").read_text())["nav"])
    return ("README.md", "k8s/README.md", *pages)


DOCS = _docs()
LANGUAGES = {"bash": "sh", "sh": "sh", "shell": "sh", "python": "python"}
FENCE = re.compile(r"^(\s*)```(\S*)\s*$")
MARKER = re.compile(r"<!--\s*docs-test:\s*(.*?)\s*-->")
COMMENT = re.compile(r"^\s*<!--.*-->\s*$")


@dataclass
class Marker:
    run: bool
    reason: str = ""
    group: str = ""
    prelude: str = ""
    serve: bool = False
    check: str = ""
    emulator: str = ""
    subs: list[tuple[str, str]] = field(default_factory=list)


@dataclass
class Block:
    doc: str
    line: int  # of the opening fence, 1-based
    section: str  # the heading above it
    language: str  # "sh" or "python"
    code: str
    marker: Marker | None
    problem: str = ""  # why the marker is missing or invalid


def parse_marker(text: str) -> Marker:
    """A marker's body (after `docs-test:`); ValueError says what is wrong with it."""
    if text.startswith("skip"):
        reason = re.fullmatch(r"skip \((.+)\)", text)
        if not reason:
            raise ValueError("a skip needs a reason: docs-test: skip (why)")
        return Marker(run=False, reason=reason.group(1))
    words = text.split()
    if not words or words[0] != "run":
        raise ValueError(f"a marker is `run ...` or `skip (why)`, got {text!r}")
    marker = Marker(run=True)
    for word in words[1:]:
        key, _, value = word.partition("=")
        if "=>" in word:
            old, _, new = word.partition("=>")
            marker.subs.append((old, new))
        elif key in ("group", "prelude", "check", "emulator") and value:
            setattr(marker, key, value)
        elif word == "serve":
            marker.serve = True
        else:
            raise ValueError(f"unknown marker option {word!r}")
    if marker.check not in ("", "k8s"):
        raise ValueError(f"unknown check {marker.check!r} (k8s)")
    if marker.prelude and marker.prelude not in PRELUDES:
        raise ValueError(f"unknown prelude {marker.prelude!r} ({', '.join(PRELUDES)})")
    return marker


def _marker_above(lines: list[str], fence: int) -> tuple[Marker | None, str]:
    """The marker among the comment lines right above line index `fence`, or why there is none."""
    i = fence - 1
    while i >= 0 and COMMENT.match(lines[i]):
        found = MARKER.search(lines[i])
        if found:
            try:
                return parse_marker(found.group(1)), ""
            except ValueError as e:
                return None, str(e)
        i -= 1
    return None, "no <!-- docs-test: run|skip (why) --> marker right above the block"


def blocks(text: str, doc: str) -> list[Block]:
    """The shell and Python blocks of a Markdown text, indented ones (in lists) dedented."""
    lines = text.splitlines()
    found, i, section = [], 0, ""
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if not opening:
            section = lines[i].lstrip("#").strip() if lines[i].startswith("#") else section
            i += 1
            continue
        end = next(j for j in range(i + 1, len(lines)) if lines[j].strip() == "```")
        language = LANGUAGES.get(opening.group(2))
        if language:
            code = textwrap.dedent("\n".join(lines[i + 1 : end])) + "\n"
            marker, problem = _marker_above(lines, i)
            found.append(Block(doc, i + 1, section, language, code, marker, problem))
        i = end + 1
    return found


def all_blocks() -> list[Block]:
    return [b for doc in DOCS for b in blocks((REPO / doc).read_text(), doc)]


def units() -> dict[str, list[Block]]:
    """The blocks to run, by test id (a group, which may span pages, or a lone block's document
    and section): a group's blocks together, in order, every other block alone."""
    out: dict[str, list[Block]] = {}
    for block in all_blocks():
        if block.marker is None or not block.marker.run:
            continue
        section = re.sub(r"[^a-z0-9]+", "-", block.section.lower())
        key = f"group:{block.marker.group}" if block.marker.group else f"{block.doc}:{section}"
        if not block.marker.group and key in out:
            key = f"{key}:{block.line}"
        out.setdefault(key, []).append(block)
    return out


# Preludes: (setup, teardown) around the Python of a group whose first block names it.
_LOOP_SETUP = """\
import jax, numpy as np
import colocar
from jax.sharding import NamedSharding, PartitionSpec as P
with open("pipeline.yaml", "w") as f:
    f.write("source: {kind: range, n: 256}\\nglobal_batch_size: 16\\nprefetch: 2\\n")
cluster = colocar.local_cluster(hosts=2)
mesh = cluster.mesh(("data",))
n = 3
state = jax.device_put(np.zeros(8, np.float32), NamedSharding(mesh, P("data")))
def train_step(state, batch):
    return state + batch["index"].sum()
"""
_LOOP_TEARDOWN = """\
assert it.get_state()["next_batch"] == n, it.get_state()
assert mngr.latest_step() == n - 1 and state.shape == (8,)
it.close()
mngr.close()
cluster.close()
"""
_ELASTIC_SETUP = """\
import os
import jax, numpy as np
import colocar
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from colocar.checkpoint import CheckpointManager
cluster = colocar.local_cluster(hosts=2)
mngr = CheckpointManager(os.path.abspath("ckpt"), cluster)
cfg = {"source": {"kind": "range", "n": 256}, "global_batch_size": 16, "prefetch": 2}
total_steps = 3
def abstract_state(mesh):
    return {"w": jax.ShapeDtypeStruct((8,), np.float32, sharding=NamedSharding(mesh, P()))}
def init_state(mesh):
    return {"w": jax.device_put(np.zeros(8, np.float32), NamedSharding(mesh, P()))}
def train_step(state, batch):
    return {"w": state["w"] + 1}, batch["index"].sum()
"""
_ELASTIC_TEARDOWN = """\
with elastic:
    state = train()
assert float(state["w"][0]) == total_steps, state
mngr.close()
cluster.close()
"""
PRELUDES = {
    "loop": (_LOOP_SETUP, _LOOP_TEARDOWN),  # README "Input pipelines" and "Checkpoints"
    "elastic": (_ELASTIC_SETUP, _ELASTIC_TEARDOWN),  # README "Elastic training"
}
