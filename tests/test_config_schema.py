"""The schema machinery (colocar/loaders/schema.py) on its own: options declared once as dataclass
fields give the parser, the error messages and `to_dict`. No JAX, no processes."""

from __future__ import annotations

from typing import Any

import pytest

from colocar.loaders.checks import ConfigError
from colocar.loaders.schema import Context, Node, config_class, option, parse_node, to_data

CTX = Context(base_dir="/", from_file=False)


@config_class
class Shape(Node):
    EXPECTED = "a mapping with a 'kind'"

    kind: str = option(choices=("box", "ball"), tag="shape")
    sides: tuple[int, ...] = option(default=(), kinds=("box",), required=True, minimum=1, doc="side lengths")
    radius: int | None = option(default=None, kinds=("ball",), required=True, minimum=1, doc="a radius")
    hollow: bool = False


@config_class
class Scene(Node):
    EXPECTED = "a mapping of scene settings"

    shape: Shape = option()
    count: int = option(default=1, minimum=1)
    labels: dict[str, Shape] | None = option(default=None, doc="a mapping of name -> shape")


def parse(raw: Any) -> Scene:
    return parse_node(Scene, raw, "", CTX)


def test_one_declaration_gives_parser_defaults_and_to_dict() -> None:
    scene = parse({"shape": {"kind": "box", "sides": [1, 2]}, "labels": {"b": {"kind": "ball", "radius": 3}}})
    assert scene == Scene(Shape("box", sides=(1, 2)), labels={"b": Shape("ball", radius=3)})
    data = scene.to_dict()
    assert data == {
        "shape": {"kind": "box", "sides": [1, 2], "hollow": False},
        "count": 1,
        "labels": {"b": {"kind": "ball", "radius": 3, "hollow": False}},
    }
    assert parse(data) == scene and parse(scene) == scene


@pytest.mark.parametrize(
    ("raw", "path", "text"),
    [
        ({"shape": {"kind": "box", "sides": [1]}, "cuont": 2}, "cuont", "unknown key; did you mean 'count'?"),
        ({}, "shape", "required key is missing; expected a mapping with a 'kind'"),
        ({"shape": {"kind": "cube"}}, "shape.kind", "expected one of 'box', 'ball', got 'cube'"),
        ({"shape": {"kind": "ball"}}, "shape.radius", "shape kind 'ball' requires 'radius'; give a radius"),
        ({"shape": {"kind": "ball", "radius": 1, "sides": [1]}}, "shape.sides", "not a setting of shape"),
        ({"shape": {"kind": "box", "sides": [1, 0]}}, "shape.sides[1]", "expected a positive int, got 0"),
        ({"shape": {"kind": "box", "sides": 3}}, "shape.sides", "expected side lengths, got int 3"),
        ({"shape": {"kind": "box", "sides": [1]}, "labels": {"": {}}}, "labels.", "non-empty strings"),
        ({"shape": {"kind": "box", "sides": [1]}, "count": True}, "count", "expected an int, got bool"),
    ],
)
def test_errors_name_the_key_path(raw: dict[str, Any], path: str, text: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse(raw)
    assert info.value.path == path and text in str(info.value), str(info.value)


def test_checking_again_keeps_stray_options_of_other_kinds() -> None:
    stray = Shape("ball", radius=2, sides=(1,))
    assert "sides" not in stray.to_dict() and to_data(stray, keep=True)["sides"] == (1,)
    with pytest.raises(ConfigError, match=r"shape\.sides: not a setting of shape kind 'ball'"):
        parse({"shape": stray})


def test_bad_declarations_fail_when_the_class_is_made() -> None:
    with pytest.raises(TypeError, match="needs a doc"):

        @config_class
        class NoDoc(Node):
            items: tuple[str, ...] = option()

    with pytest.raises(TypeError, match="kinds must be choices"):

        @config_class
        class BadKind(Node):
            kind: str = option(choices=("a",), tag="thing")
            x: int = option(default=0, kinds=("b",))
