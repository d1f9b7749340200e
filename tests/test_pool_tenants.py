"""The tenants file of a shared pool: what it accepts, and the clear error for each mistake."""

from __future__ import annotations

import os

import pytest

from colocar.pool.tenants import TenantsFileError, parse
from colocar.protocol.tokens import write_token_file


@pytest.fixture
def folder(tmp_path):
    for name in ("a", "b"):
        write_token_file(str(tmp_path / f"{name}.token"), f"token-of-{name}")
    return str(tmp_path)


def test_a_tenant_gets_its_token_priority_and_quotas_with_defaults(folder):
    tenants = parse(
        "tenants:\n  a: {token_file: a.token, priority: 3, quotas: {arena: 1G, calls: 2}}\n", folder
    )
    a = tenants["a"]
    assert (a.token, a.priority, a.arena, a.calls, a.processes, a.sessions) == (
        "token-of-a",
        3,
        1 << 30,
        2,
        1,
        4,
    )


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("tenants: [a, b]", "expected a mapping 'tenants:'"),
        ("tenants: {a: {priority: 1}}", "tenant 'a': needs token_file"),
        ("tenants: {a: {token_file: a.token, quotas: {gpus: 1}}}", r"unknown keys \['quotas.gpus'\]"),
        ("tenants: {a: {token_file: a.token, color: red}}", r"unknown keys \['color'\]"),
        ("tenants: {a: {token_file: a.token, quotas: {arena: lots}}}", "tenant 'a'"),
        ("tenants: {a: {token_file: a.token, quotas: {calls: 0}}}", "quotas must be positive"),
        ("tenants: {a: {token_file: a.token}, b: {token_file: a.token}}", "two tenants share a token"),
        ("tenants: {a: {token_file: missing.token}}", "tenant 'a': token_file .*missing.token"),
        ("tenants: {'a b': {token_file: a.token}}", "letters, digits"),
        ("tenants: {a: [unclosed", "not YAML"),
    ],
)
def test_each_mistake_is_named(folder, text, error):
    with pytest.raises(TenantsFileError, match=error):
        parse(text, folder)


def test_a_token_file_others_can_read_is_refused(folder):
    os.chmod(os.path.join(folder, "b.token"), 0o644)
    with pytest.raises(TenantsFileError, match="readable by group or others"):
        parse("tenants: {b: {token_file: b.token}}", folder)
