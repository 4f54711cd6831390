"""The development-only local sandbox: same interface and runner, no isolation."""

from __future__ import annotations

import time

import pytest

from sandboxes.docker import SandboxConfig, make_sandbox_pool
from sandboxes.local import LocalSandboxPool

pytestmark = pytest.mark.anyio


def local_config(**overrides) -> SandboxConfig:
    values = dict(backend="local", timeout_s=1.5, max_timeout_s=1.5, host_grace_s=2.0,
                  max_output_bytes=4096)
    values.update(overrides)
    return SandboxConfig(**values)


async def test_session_state_shell_and_errors(capfd) -> None:
    async with make_sandbox_pool(local_config()) as pool:
        assert isinstance(pool, LocalSandboxPool)
        async with pool.session() as sb:
            await sb.exec("x = 40")
            r = await sb.exec("x + 2")
            assert (r.status, r.stdout) == ("ok", "42\n")
            r = await sb.exec("echo hi; exit 2", language="shell")
            assert (r.stdout, r.exit_code) == ("hi\n", 2)
            r = await sb.exec("undefined_name")
            assert r.exit_code == 1 and "NameError" in r.stderr
    assert "ISOLATES NOTHING" in capfd.readouterr().err


async def test_timeout_truncation_and_reset() -> None:
    async with LocalSandboxPool(local_config()) as pool:
        async with pool.session() as sb:
            await sb.exec("kept = 1")
            start = time.monotonic()
            r = await sb.exec("while True: pass", timeout=1000)
            assert r.status == "timeout" and r.session_reset
            assert time.monotonic() - start < 1.5 + 5
            assert "NameError" in (await sb.exec("kept")).stderr
            r = await sb.exec("print('y' * 100000)")
            assert r.status == "output_truncated" and len(r.stdout) == 4096
            r = await sb.exec("(sleep 30; echo late) & echo now", language="shell")
            assert r.stdout == "now\n"


async def test_sessions_are_separate() -> None:
    async with LocalSandboxPool(local_config()) as pool:
        async with pool.session() as a, pool.session() as b:
            await a.exec("import os\nopen('f', 'w').write('a')")
            r = await b.exec("import os\nos.listdir('.')")
            assert r.stdout == "[]\n"
