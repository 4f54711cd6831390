"""Sandbox configs (sandboxes/config.py): the backend is the class ``_target_`` names, wherever
it lives; every mistake is one line naming the key."""

from __future__ import annotations

import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from envs.code import CodeSpec
from sandboxes.api import SandboxConfigError
from sandboxes.config import SandboxConfig, make_sandbox_pool, sandbox_config
from sandboxes.docker import DockerSandboxConfig, DockerSandboxPool
from sandboxes.local import LocalSandboxConfig, LocalSandboxPool

CONF = Path(__file__).resolve().parents[2] / "conf" / "sandbox"
DOCKER = "sandboxes.docker.DockerSandboxConfig"


@pytest.mark.parametrize("name,cls", [("docker", DockerSandboxConfig),
                                      ("local", LocalSandboxConfig)])
def test_each_shipped_file_builds_its_backend_with_its_values(name: str, cls: type) -> None:
    node = OmegaConf.load(CONF / f"{name}.yaml")
    config = sandbox_config(node)
    assert type(config) is cls
    assert config == cls(**{k: v for k, v in OmegaConf.to_container(node).items()
                            if k != "_target_"})
    assert "backend" not in node  # the class is the choice


def test_none_means_docker_defaults_and_a_config_passes_through() -> None:
    assert sandbox_config(None) == DockerSandboxConfig()
    local = LocalSandboxConfig(timeout_s=1.0)
    assert sandbox_config(local) is local
    assert isinstance(local.pool(), LocalSandboxPool)
    assert isinstance(DockerSandboxConfig().pool(), DockerSandboxPool)


@pytest.mark.parametrize("mapping,message", [
    ({"_target_": DOCKER, "memroy_mb": 1},
     f"sandbox.memroy_mb is not a key of {DOCKER} (did you mean memory_mb?)"),
    ({"_target_": "sandboxes.local.LocalSandboxConfig", "image": "x"},
     "sandbox.image is not a key of sandboxes.local.LocalSandboxConfig"),
    ({"timeout_s": 1.0}, "sandbox._target_ must name a SandboxConfig subclass"),
    ({"_target_": "nowhere.Config"},
     "sandbox._target_=nowhere.Config cannot be imported: No module named 'nowhere'"),
    ({"_target_": "sandboxes.docker.NoSuchConfig"},
     ("sandbox._target_=sandboxes.docker.NoSuchConfig cannot be imported: module "
      "sandboxes.docker has no NoSuchConfig")),
    ({"_target_": "collections.OrderedDict"},
     "sandbox._target_=collections.OrderedDict is not a subclass of sandboxes.config.SandboxConfig"),
    ({"_target_": "sandboxes.config.SandboxConfig"},
     "sandbox._target_=sandboxes.config.SandboxConfig is abstract"),
    ({"_target_": DOCKER, "timeout_s": -1}, "sandbox.timeout_s must be > 0, got -1"),
    ({"_target_": DOCKER, "timeout_s": "ten"}, "sandbox.timeout_s must be a number, got 'ten'"),
    ({"_target_": DOCKER, "pool_size": 1.5}, "sandbox.pool_size must be a whole number, got 1.5"),
    ({"_target_": DOCKER, "max_output_bytes": True},
     "sandbox.max_output_bytes must be a whole number, got True"),
    ({"_target_": DOCKER, "user": "root"}, "sandbox.user must be a uid other than root"),
    ({"_target_": DOCKER, "runtime": "run sc"},
     "sandbox.runtime must be the name of a runtime registered with Docker, e.g. runc or runsc"),
    ({"_target_": "sandboxes.local.LocalSandboxConfig", "nofile": 3},
     "sandbox.nofile must be >= 16, got 3"),
], ids=lambda v: v if isinstance(v, str) else None)
def test_a_bad_config_is_one_line_naming_the_key(mapping: dict, message: str) -> None:
    with pytest.raises(SandboxConfigError) as info:
        sandbox_config(mapping)
    assert str(info.value).startswith(message)
    assert "\n" not in str(info.value)
    assert isinstance(info.value, ValueError)


def test_the_environment_checks_its_sandbox_when_it_is_built() -> None:
    with pytest.raises(SandboxConfigError, match="sandbox.timeout_s must be > 0, got -1"):
        CodeSpec(sandbox={"_target_": DOCKER, "timeout_s": -1})
    with pytest.raises(SandboxConfigError, match="sandbox._target_=nowhere.X cannot be imported"):
        CodeSpec(sandbox={"_target_": "nowhere.X"})


def test_limits_are_shared_and_only_shortened() -> None:
    for cls in (DockerSandboxConfig, LocalSandboxConfig):
        config = cls(timeout_s=2.0, max_timeout_s=4.0, max_output_bytes=100)
        assert isinstance(config, SandboxConfig)
        assert config.call_limits(None, None) == (2.0, 100)
        assert config.call_limits(1000.0, None) == (4.0, 100)


OUTSIDE = '''
    """A sandbox backend that is no part of the sandboxes package: each call a subprocess."""

    from __future__ import annotations

    import sys
    import time
    from collections.abc import AsyncIterator
    from contextlib import asynccontextmanager
    from dataclasses import dataclass

    import anyio

    from sandboxes.api import ExecLimits, ExecResult, Language, Sandbox, SandboxPool
    from sandboxes.config import SandboxConfig

    CALLS: list[tuple[str, str]] = []  # (tag, code) of every exec


    @dataclass(frozen=True, kw_only=True)
    class SubprocessConfig(SandboxConfig):
        tag: str = "untagged"
        python: str = sys.executable

        def __post_init__(self) -> None:
            super().__post_init__()
            self.require("tag", bool(self.tag), "a non-empty string")

        def pool(self) -> SubprocessPool:
            return SubprocessPool(self)


    class SubprocessSandbox(Sandbox):
        def __init__(self, config: SubprocessConfig) -> None:
            self.config = config

        async def exec(self, code: str, *, language: Language = "python",
                       timeout: float | None = None,
                       limits: ExecLimits | None = None) -> ExecResult:
            timeout_s, max_output = self.config.call_limits(timeout, limits)
            CALLS.append((self.config.tag, code))
            argv = ([self.config.python, "-I", "-c", code] if language == "python"
                    else ["/bin/sh", "-c", code])
            start = time.perf_counter()
            with anyio.move_on_after(timeout_s):
                done = await anyio.run_process(argv, check=False)
                return ExecResult(done.stdout.decode()[:max_output], done.stderr.decode(),
                                  done.returncode, "ok", time.perf_counter() - start)
            return ExecResult("", "", None, "timeout", time.perf_counter() - start)


    class SubprocessPool(SandboxPool):
        def __init__(self, config: SubprocessConfig) -> None:
            self.config = config
            self.open = False

        async def __aenter__(self) -> SubprocessPool:
            self.open = True
            return self

        @asynccontextmanager
        async def session(self) -> AsyncIterator[SubprocessSandbox]:
            assert self.open
            yield SubprocessSandbox(self.config)

        async def aclose(self) -> None:
            self.open = False
'''


@pytest.fixture
def outside_backend(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A module ``outside_backend`` on sys.path, and its YAML config beside it."""
    (tmp_path / "outside_backend.py").write_text(textwrap.dedent(OUTSIDE))
    (tmp_path / "outside.yaml").write_text(
        "_target_: outside_backend.SubprocessConfig\ntag: from-yaml\ntimeout_s: 5.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path / "outside.yaml"
    sys.modules.pop("outside_backend", None)


@pytest.mark.anyio
async def test_a_backend_from_a_module_outside_sandboxes_runs_a_code_episode(
        outside_backend: Path) -> None:
    node = OmegaConf.load(outside_backend)  # as Hydra hands it over with _recursive_=False
    spec = CodeSpec(sandbox=node, train_size=4, eval_size=0)
    backend = sys.modules["outside_backend"]
    assert type(spec.sandbox_config) is backend.SubprocessConfig
    assert spec.sandbox_config.tag == "from-yaml" and spec.sandbox_config.timeout_s == 5.0
    task = spec.tasks("train")[0]
    async with spec.running():
        env = spec.make_env()
        assert await env.reset(task) == task.messages
        assert (await env.step(task.answer)).done
        reward = await env.reward()
        await env.aclose()
    assert reward.total == 1.0 and reward.components["tests_passed/ran_ok"] == 1.0
    assert len(backend.CALLS) == 1
    tag, code = backend.CALLS[0]
    assert tag == "from-yaml" and repr(task.answer) in code  # the grader ran through it
    with pytest.raises(SandboxConfigError, match="sandbox.tag must be a non-empty string"):
        make_sandbox_pool({"_target_": "outside_backend.SubprocessConfig", "tag": ""})
