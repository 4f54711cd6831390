"""The development-only local sandbox: same interface and runner, no isolation."""

from __future__ import annotations

import time

import pytest

from sandboxes.config import make_sandbox_pool
from sandboxes.local import LocalSandboxConfig, LocalSandboxPool

pytestmark = pytest.mark.anyio


def local_config(**overrides) -> LocalSandboxConfig:
    values = dict(timeout_s=1.5, max_timeout_s=1.5, host_grace_s=2.0, max_output_bytes=4096)
    values.update(overrides)
    return LocalSandboxConfig(**values)


async def test_session_state_shell_and_errors(capfd) -> None:
    mapping = {"_target_": "sandboxes.local.LocalSandboxConfig", "timeout_s": 1.5}
    async with make_sandbox_pool(mapping) as pool:
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


async def test_a_segfault_is_killed_on_time_and_the_session_goes_on() -> None:
    async with local_config().pool() as pool, pool.session() as sb:
        await sb.exec("kept = 1")
        start = time.monotonic()
        r = await sb.exec("import ctypes\nctypes.string_at(0)")
        assert time.monotonic() - start < 1.5 + 5
        assert (r.status, r.exit_code, r.session_reset) == ("killed", 128 + 11, True)
        assert "Segmentation fault" in r.stderr and '"<cell>", line 2' in r.stderr
        assert "NameError" in (await sb.exec("kept")).stderr  # a fresh namespace
        assert (await sb.exec("print('next')")).stdout == "next\n"
