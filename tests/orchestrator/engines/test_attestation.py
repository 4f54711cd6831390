"""Weight attestation on the torch engine: after every load the engine's fingerprint, computed
from the tensors it holds, equals the one the update was published with; the faults it must
expose (a skipped load, a partial load, an adapter of another version, a restart from the
initial weights) leave it different; what it generates carries version and fingerprint."""

from __future__ import annotations

import pytest
import torch
from helpers import TINY_MODEL

from orchestrator.engines.base import sync_weights
from orchestrator.engines.torch_engine import TorchEngine
from orchestrator.models.policy import build_policy
from orchestrator.types import SamplingParams
from orchestrator.weights.update import Adapters, WeightUpdate

pytestmark = pytest.mark.anyio


def trained(state: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    """``state`` after a made-up optimiser step: every tensor moved a little (as a model holds
    it: tied tensors stay tied)."""
    g = torch.Generator().manual_seed(seed)
    model = build_policy(TINY_MODEL).model
    model.load_state_dict({k: v + 1e-3 * torch.randn(v.shape, generator=g)
                           for k, v in state.items()})
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.fixture
def start() -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in build_policy(TINY_MODEL).model.state_dict().items()}


async def test_the_engine_reports_the_fingerprint_published_for_each_version(start) -> None:
    engine = TorchEngine(TINY_MODEL, WeightUpdate.by_reference(0, start, leased=False))
    assert engine.attests
    assert engine.fingerprint == WeightUpdate.by_reference(0, start).attested().fingerprint
    async with engine:
        state = start
        for version in (1, 2):
            state = trained(state, version)
            update = WeightUpdate.by_reference(version, state, leased=False).attested()
            await sync_weights(engine, update)
            assert (engine.version, engine.fingerprint) == (version, update.fingerprint)
            out = await engine.generate([5, 6, 7], SamplingParams(max_tokens=3, seed=1))
            assert out.fingerprints == ((version, update.fingerprint),)


async def test_the_trainer_is_released_once_copied_before_the_engine_fingerprints(start) -> None:
    # the fingerprint reads the engine's own tensors: the trainer (waiting on the lease for its
    # next step) must not wait for it too
    engine = TorchEngine(TINY_MODEL, WeightUpdate.by_reference(0, start, leased=False))
    async with engine:
        update = WeightUpdate.by_reference(1, trained(start, 1)).attested()  # leased
        released_when_fingerprinted = []
        fingerprint_held = engine._fingerprint

        def spy() -> None:
            released_when_fingerprinted.append(update.released)
            fingerprint_held()

        engine._fingerprint = spy  # type: ignore[method-assign]
        await sync_weights(engine, update)
        assert released_when_fingerprinted == [True]
        assert (engine.version, engine.fingerprint) == (1, update.fingerprint)


async def test_the_engine_fingerprints_in_its_next_step_before_any_token_of_the_new_weights(
        start, monkeypatch: pytest.MonkeyPatch) -> None:
    # the fingerprint after a load is not computed in the sync (the engine resumes at once) nor
    # in a thread of its own, but by the engine's next decoding step, before it samples a token
    # of the new weights; every token of them carries it
    import threading

    import anyio

    from orchestrator.engines import torch_engine

    engine = TorchEngine(TINY_MODEL, WeightUpdate.by_reference(0, start, leased=False))
    async with engine:
        await engine.attested()  # the starting weights' (the next load waits for it)
        update = WeightUpdate.by_reference(1, trained(start, 1), leased=False).attested()
        computing, finish = threading.Event(), threading.Event()

        def slow_fingerprint(tensors):
            computing.set()
            finish.wait(10)
            return torch_engine.fingerprint.__wrapped__(tensors)

        slow_fingerprint.__wrapped__ = torch_engine.fingerprint  # type: ignore[attr-defined]
        monkeypatch.setattr(torch_engine, "fingerprint", slow_fingerprint)
        with anyio.fail_after(5):  # computed in the sync, this would wait for ``finish``
            await sync_weights(engine, update)
        assert engine.version == 1 and not computing.is_set()
        result: list = []

        async def generate(seed: int) -> None:
            result.append(await engine.generate([5, 6, 7], SamplingParams(max_tokens=3,
                                                                           seed=seed)))

        threads = anyio.to_thread.current_default_thread_limiter()
        async with anyio.create_task_group() as tg:
            for seed in range(8):
                tg.start_soon(generate, seed)
            with anyio.fail_after(5):
                await anyio.to_thread.run_sync(computing.wait)
            await anyio.sleep(0.2)
            assert not result  # no token before the fingerprint
            assert threads.borrowed_tokens == 1  # the engine's step thread alone: no waiters
            finish.set()
        assert [r.fingerprints for r in result] == [((1, update.fingerprint),)] * 8

        # an engine that generates nothing after a load computes it when asked
        update2 = WeightUpdate.by_reference(2, trained(start, 2), leased=False).attested()
        await sync_weights(engine, update2)
        assert await engine.attested() == update2.fingerprint


async def test_a_bf16_engine_fed_float32_master_weights_matches_the_wire_dtype(start) -> None:
    engine = TorchEngine({**TINY_MODEL, "dtype": "bfloat16"},
                         WeightUpdate.by_reference(0, start, leased=False))
    async with engine:
        update = WeightUpdate.by_reference(1, trained(start, 1), leased=False).with_wire_dtype(
            torch.bfloat16).attested()
        await sync_weights(engine, update)
        assert engine.fingerprint == update.fingerprint
        assert update.fingerprint == update.serialised().attested().fingerprint  # over the wire


class SkippingEngine(TorchEngine):
    """Faults: a load skipped (the version set all the same), or one tensor left old."""

    def __init__(self, *args, fault: str, **kwargs) -> None:
        self.fault = "none"  # the starting weights load whole
        super().__init__(*args, **kwargs)
        self.fault = fault

    def _load(self, update: WeightUpdate) -> None:
        if self.fault == "none":
            return super()._load(update)
        if self.fault == "skip":
            self.version = update.version
            return
        tensors = dict(update.tensors())
        first = min(tensors)
        tensors[first] = self.model.state_dict()[first].clone()
        super()._load(WeightUpdate.by_reference(update.version, tensors, leased=False))


@pytest.mark.parametrize("fault", ["skip", "partial"])
async def test_a_skipped_or_partial_load_is_exposed(start, fault: str) -> None:
    engine = SkippingEngine(TINY_MODEL, WeightUpdate.by_reference(0, start, leased=False),
                            fault=fault)
    async with engine:
        update = WeightUpdate.by_reference(1, trained(start, 1), leased=False).attested()
        await sync_weights(engine, update)
        assert engine.version == 1
        assert engine.fingerprint != update.fingerprint
        out = await engine.generate([5, 6], SamplingParams(max_tokens=2, seed=1))
        assert out.fingerprints == ((1, engine.fingerprint),)


async def test_an_engine_restarted_from_the_initial_weights_is_exposed(start) -> None:
    update = WeightUpdate.by_reference(3, trained(start, 3), leased=False).attested()
    async with TorchEngine(TINY_MODEL, WeightUpdate.by_reference(0, start, leased=False)) as restarted:
        restarted.version = 3  # told the current version, holding the initial weights
        assert restarted.fingerprint != update.fingerprint


def lora(start: dict[str, torch.Tensor], seed: int, with_base: bool) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    name = "model.layers.0.self_attn.q_proj.weight"
    out, inp = start[name].shape
    tensors = {f"{name}::lora_A": torch.randn(2, inp, generator=g),
               f"{name}::lora_B": torch.randn(out, 2, generator=g)}
    return {**tensors, **(start if with_base else {})}


async def test_an_adapter_of_another_version_is_exposed(start) -> None:
    adapters = Adapters(scale=0.5, modules=("model.layers.0.self_attn.q_proj.weight",))
    first = WeightUpdate.by_reference(1, lora(start, 1, True), leased=False).with_adapters(
        adapters).attested()
    engine = TorchEngine(TINY_MODEL, first)
    assert engine.fingerprint == first.fingerprint
    second = WeightUpdate.by_reference(2, lora(start, 2, False), leased=False).with_adapters(
        adapters).attested()
    async with engine:
        await sync_weights(engine, second)
        assert engine.fingerprint == second.fingerprint
        stale = WeightUpdate.by_reference(3, lora(start, 2, False), leased=False).with_adapters(
            adapters)  # version 3 carrying version 2's adapter
        third = WeightUpdate.by_reference(3, lora(start, 3, False), leased=False).with_adapters(
            adapters).attested()
        await sync_weights(engine, stale)
        assert engine.version == 3
        assert engine.fingerprint != third.fingerprint


async def test_a_router_reports_each_replica_and_names_it_on_what_it_generates(start) -> None:
    from orchestrator.engines.router import EngineRouter

    engines = [TorchEngine(TINY_MODEL, WeightUpdate.by_reference(0, start, leased=False))
               for _ in range(2)]
    async with EngineRouter(engines, names=["a", "b"], routing="round_robin") as router:
        assert router.attests
        update = WeightUpdate.by_reference(1, trained(start, 1), leased=False).attested()
        await sync_weights(router, update)
        assert router.fingerprints == {"a": (1, update.fingerprint), "b": (1, update.fingerprint)}
        outs = [await router.generate([5, 6], SamplingParams(max_tokens=2, seed=1))
                for _ in range(2)]
        assert [o.engine for o in outs] == ["a", "b"]
        assert all(o.fingerprints == ((1, update.fingerprint),) for o in outs)
