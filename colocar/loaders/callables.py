"""Callables named in a pipeline config: ``"module:function"`` strings, or Python objects.

The controller resolves every name here to check it (importable, callable, the right arity for its
transform kind); the sidecars, which run with the same `sys.path`, resolve it again.
"""

from __future__ import annotations

import builtins
import importlib
import inspect
from collections.abc import Callable
from typing import Any

from .checks import ConfigError, describe, suggest


def resolve_callable(spec: str | Callable[..., Any], where: str) -> Callable[..., Any]:
    """Resolve ``"module:function"`` (a dotted attribute path may follow the colon) to the object.

    A Python callable is returned as it is. Raises `ConfigError` naming `where` (the key path) if
    the module cannot be imported, the attribute is missing or the object is not callable.
    """
    if not isinstance(spec, str):
        if builtins.callable(spec):
            return spec
        raise ConfigError(where, f"expected 'module:function' or a Python callable, got {describe(spec)}")
    module_name, sep, attr_path = spec.partition(":")
    module_name, attr_path = module_name.strip(), attr_path.strip()
    if not sep or not module_name or not attr_path:
        raise ConfigError(
            where,
            f"expected 'module:function' (e.g. 'my_transforms:decode'), got {spec!r}",
        )
    obj: Any = _import(module_name, spec, where)
    done = module_name
    for part in attr_path.split("."):
        if not hasattr(obj, part):
            names = [n for n in dir(obj) if not n.startswith("_")]
            raise ConfigError(
                where,
                f"{done!r} has no attribute {part!r} (resolving {spec!r}){suggest(part, names)}",
            )
        obj = getattr(obj, part)
        done = f"{done}:{part}" if done == module_name else f"{done}.{part}"
    if not builtins.callable(obj):
        raise ConfigError(where, f"{spec!r} is not callable (it is {describe(obj)})")
    return obj  # type: ignore[no-any-return]


def _import(module_name: str, spec: str, where: str) -> Any:
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name is not None and (module_name == e.name or module_name.startswith(e.name + ".")):
            raise ConfigError(
                where,
                f"cannot import module {module_name!r} of {spec!r}: no module named {e.name!r}; the "
                "module must be importable by the controller (installed, or its directory on sys.path "
                "/ PYTHONPATH); the sidecars get the same sys.path",
            ) from None
        raise ConfigError(where, f"importing module {module_name!r} of {spec!r} failed: {e!r}") from None
    except Exception as e:  # noqa: BLE001 - any import-time failure of user code is a config error
        raise ConfigError(where, f"importing module {module_name!r} of {spec!r} failed: {e!r}") from None


def callable_name(fn: str | Callable[..., Any]) -> str:
    """``"module:qualname"`` of `fn` if importing that name gives `fn` back, else a description.

    The description (``"<python callable ...>"``) is for logs; it does not load back.
    """
    if isinstance(fn, str):
        return fn
    module = getattr(fn, "__module__", None)
    qualname = getattr(fn, "__qualname__", None)
    if isinstance(module, str) and isinstance(qualname, str) and "<" not in qualname:
        name = f"{module}:{qualname}"
        try:
            if resolve_callable(name, "") is fn:
                return name
        except ConfigError:
            pass
    return f"<python callable {module}.{qualname if qualname is not None else repr(fn)}>"


def check_arity(fn: Callable[..., Any], kind: str, path: str, spec: Any) -> None:
    """Catch a map given where a random_map is expected (and back) while we can still say so."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return  # some builtins have no signature; the sidecar will find out
    args: tuple[None, ...] = (None, None) if kind == "random_map" else (None,)
    try:
        sig.bind(*args)
    except TypeError:
        call = "fn(record, rng)" if kind == "random_map" else "fn(record)"
        other = "'map' or 'filter'" if kind == "random_map" else "'random_map'"
        raise ConfigError(
            path,
            f"{callable_name(spec)} has signature {sig}, but kind {kind!r} calls it as {call}; "
            f"fix the signature or use kind {other}",
        ) from None


def check_no_arguments(fn: Callable[..., Any], path: str, spec: Any) -> None:
    """A source callable is called as fn(): name its parameters that have no default."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return  # some builtins have no signature; the sidecar will find out
    try:
        sig.bind()
    except TypeError:
        kinds = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
        needed = [n for n, p in sig.parameters.items() if p.default is p.empty and p.kind not in kinds]
        raise ConfigError(
            path,
            f"{callable_name(spec)} has signature {sig}, but a source callable is called with no "
            f"arguments and it needs {', '.join(repr(n) for n in needed)}; give those parameters "
            "defaults, or point 'callable' at a function that takes none (functools.partial in a module)",
        ) from None
