"""How a colocated function or method runs, and JAX's rule for specializing it (controller).

`Options` holds what the decorators and `specialize` set. As in
`jax.experimental.colocated_python`, `in_specs`, `out_specs_fn` and `devices` are each given
once along a chain of `specialize` calls (a second raises ValueError), and `in_specs`, once
given, must describe every call's arguments (`check_in_specs`): a call that does not match
raises instead of running. colocar's own options (timeout, per-device shards) may be changed
again.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import jax


@dataclass(frozen=True)
class Options:
    """How a colocated function or method runs; `specialize` and the decorators set these."""

    in_specs: Any = None
    out_specs_fn: Callable[..., Any] | None = None
    devices: tuple[Any, ...] | None = None
    processes: bool = False
    timeout: float | None = None
    per_device_shards: bool = False
    prefetch: int = 2

    def specialize(
        self,
        in_specs: Any = None,
        out_specs_fn: Callable[..., Any] | None = None,
        devices: Sequence[Any] | None = None,
        *,
        per_device_shards: bool | None = None,
        timeout: float | None = None,
    ) -> Options:
        """These options with more given; JAX's rule: in_specs, out_specs_fn and devices once."""
        for what, given, held in (
            ("in_specs", in_specs, self.in_specs),
            ("out_specs_fn", out_specs_fn, self.out_specs_fn),
            ("devices", devices, self.devices),
        ):
            if given is not None and held is not None:
                raise ValueError(f"{what} already specified (specialize gives it once, as in JAX)")
        return replace(
            self,
            in_specs=self.in_specs if in_specs is None else in_specs,
            out_specs_fn=self.out_specs_fn if out_specs_fn is None else out_specs_fn,
            devices=self.devices if devices is None else tuple(devices),
            per_device_shards=self.per_device_shards if per_device_shards is None else per_device_shards,
            timeout=self.timeout if timeout is None else timeout,
        )


def spec_of(x: Any) -> Any:
    """A `jax.Array` as its ShapeDtypeStruct (with its sharding); any other value as it is."""
    if isinstance(x, jax.Array):
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
    return x


def check_in_specs(in_specs: Any, args: tuple, kwargs: dict, name: str) -> None:
    """Raises ValueError unless `in_specs` describes `(args, kwargs)`.

    As in JAX, the pytree structures must be the same and each `jax.Array` must have the
    shape, dtype and sharding of its spec (a ShapeDtypeStruct). colocar also takes plain
    values, which their spec gives as themselves (compared with ==).
    """
    given, given_def = jax.tree_util.tree_flatten_with_path(in_specs)
    actual, actual_def = jax.tree_util.tree_flatten((args, kwargs))
    if given_def != actual_def:  # type: ignore[operator]
        raise ValueError(
            f"{name}: the arguments do not have the structure of the in_specs given to "
            f"specialize: in_specs {given_def}, arguments {actual_def}"
        )
    for (path, spec), x in zip(given, actual, strict=True):
        problem = _mismatch(spec, x)
        if problem:
            raise ValueError(
                f"{name}: argument {jax.tree_util.keystr(path)} does not match the in_specs given "
                f"to specialize: {problem}"
            )


def _mismatch(spec: Any, x: Any) -> str:
    """Why argument `x` does not match its spec; "" if it does."""
    is_spec = all(hasattr(spec, a) for a in ("shape", "dtype", "sharding"))
    if not isinstance(x, jax.Array):
        if is_spec:
            return f"the spec is {spec}, the argument a {type(x).__name__}, not a jax.Array"
        return "" if same_value(spec, x) else f"the spec is {spec!r}, the argument {x!r}"
    if not is_spec:
        return f"the spec is {spec!r}, the argument a jax.Array {x.dtype}{list(x.shape)}"
    if tuple(spec.shape) != tuple(x.shape) or spec.dtype != x.dtype:
        return f"the spec is {spec.dtype}{list(spec.shape)}, the argument {x.dtype}{list(x.shape)}"
    if spec.sharding is None or not (
        spec.sharding == x.sharding or spec.sharding.is_equivalent_to(x.sharding, x.ndim)
    ):
        return f"the spec's sharding is {spec.sharding}, the argument's {x.sharding}"
    return ""


def same_value(a: Any, b: Any) -> bool:
    """a == b, or `a is b` where == has no single truth value (arrays)."""
    try:
        return bool(a == b)
    except Exception:
        return a is b
