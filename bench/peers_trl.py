"""The TRL side of ``bench.peers`` and ``bench.real_model``, and what both sides share.

Shared: an experiment's config (the default one unless told) and the RL settings read from
it (:class:`RLSettings`), the warm-started policy (:func:`warm_policy`, also the project
runs' ``model._target_``) and the character tokenizer as a Hugging Face one
(:func:`char_tokenizer_fast`).

The TRL run (``python -m bench.peers_trl``, started by ``bench.peers`` or
``bench.real_model`` in a process of its own): Hugging Face TRL's ``GRPOTrainer`` on the
project's model, task and cores. TRL is imported here only, inside :func:`train`.

What it trains (:func:`trl_side`): for ``bench.peers``, the default ``model=tiny`` policy
(:func:`warm_policy`: the tiny Llama with eager attention and the supervised warm start's
weights) with the character tokenizer wrapped as a ``PreTrainedTokenizerFast``
(:func:`char_tokenizer_fast`: the same ids, and a chat template that renders the same prompt
tokens as ``CharTokenizer.chat_prompt``), on the arithmetic environment's train split; for
``bench.real_model`` (``--experiment rg_smol``, no ``--weights``), the experiment's
checkpoint (SmolLM2) and its own tokenizer, whose chat template the project renders too;
for their ``--smoke`` sizes, the toy model (overrides of the experiment after ``--``, as its
project run was given them), built from config with the same seed as the project's run, and
the character tokenizer wrapped. The reward is the environment's own, a single-turn
episode's (:func:`score`: an async reward function; TRL runs it on its event loop). The
settings below are the default experiment's; any other's are read from its config the same
way. An algorithm they cannot reproduce (a loss other than PPO's clip, a dual clip, another
advantage or aggregation, a KL or entropy term: :class:`NotComparable`) is refused in one line
(exit 3): the comparison would not be like for like.

Settings, and why:

* the batch: ``per_device_train_batch_size=64`` completions, ``num_generations=4``,
  ``gradient_accumulation_steps=1``, ``steps_per_generation=1``: 16 prompts x 4 samples
  generated and trained per optimiser step, once (``num_iterations=1``): on-policy, as the
  project at ``k = 0``;
* the loss: ``loss_type="dapo"`` (TRL's default: token-level, summed over the generation
  batch and divided by its completion tokens, which with one process and one accumulation
  step is the project's aggregation), ``epsilon=0.2``, ``epsilon_high=0.28`` (the project's
  ``algo.loss.eps_low`` / ``eps_high``), ``beta=0.0`` (no KL term, no reference model),
  ``scale_rewards="group"`` (advantages divided by the group's std, as ``normalize_std``;
  TRL's std is the unbiased one plus 1e-4, the project's the population one plus 1e-6:
  with groups of 4 TRL's advantages are about 0.87x the project's, which Adam mostly
  absorbs), ``mask_truncated_completions=False`` (the project trains length-capped samples
  too); TRL's defaults ``top_entropy_quantile=1.0`` and ``entropy_coef=0.0`` kept;
* the optimiser: the project's own (``torch.optim.AdamW``: lr 1e-4, betas (0.9, 0.99), eps
  1e-8, no weight decay, plus its ``LambdaLR`` warm-up ``min(1, (step + 1) / 20)``) handed
  in through ``optimizers=``: TRL's ``constant_with_warmup`` would give the first step lr 0
  (one step behind the project's schedule). The same values are written into the config
  (``learning_rate``, ``adam_beta*``, ``warmup_steps``, ``optim="adamw_torch"``) for the
  record; ``max_grad_norm=1.0``;
* sampling: ``temperature=0.85`` (TRL also scores tokens at that temperature, as the
  project's trainer does), ``top_p=1.0``, ``top_k=0``, ``max_completion_length=8``, with
  ``transformers``' ``generate`` (TRL's path without vLLM);
* CPU: ``use_cpu=True``, ``bf16=False`` (TRL defaults to bf16; the project trains in
  float32), ``activation_checkpointing=False`` (TRL defaults ``gradient_checkpointing`` to
  on, which only costs time on a 1M-parameter model; transformers 5.23 renamed it and warns
  about the old name, and TRL 1.16 still calls ``is_gradient_checkpointing``, one more
  FutureWarning in the log), ``use_vllm=False``, ``use_transformers_continuous_batching=False``,
  ``torch.set_num_threads(threads)`` (2: both cores), ``dataloader_num_workers=0``;
* bookkeeping off the timed path: ``report_to="none"``, ``save_strategy="no"``,
  ``eval_strategy="no"``, ``disable_tqdm=True``, ``log_completions=False``, TRL's own
  logging every ``logging_steps=10`` steps (its default).

What it writes into ``--out``: ``metrics.jsonl`` (per step: mean training reward, seconds
since training began), ``snapshots/step-<N>.safetensors`` every ``--every`` steps
(the weights copied in memory at the end of the step, written after training) and
``summary.json`` (RL wall time: from TRL's ``on_train_begin`` to the end of the last step,
so model loading and trainer set-up are excluded).
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig

from bench.cli import refuse
from envs.base import EnvSpec, Task
from orchestrator.config.read import build_env, scalar, section, typed
from orchestrator.config.schema import RolloutConfig
from orchestrator.models.policy import Policy, build_policy, checkpoint_dir, tiny_policy
from orchestrator.models.tokenizer import CharTokenizer

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

REPO = Path(__file__).resolve().parents[1]


def base_args(name: str) -> list[str]:
    """The overrides every run of experiment ``name`` gets here (no logger, no progress bar,
    on the CPU)."""
    return [f"experiment={name}", "logger=none", "progress=false", "model.device=cpu"]


BASE = base_args("arithmetic")  # the default experiment

# -- what both sides share: the experiment's settings, the model, the tokenizer -----------------

_configs: dict[tuple[str, ...], DictConfig] = {}


def experiment(*overrides: str, base: Sequence[str] = BASE) -> DictConfig:
    """The config of the experiment ``base`` names (the default one unless told), composed
    once per set of overrides; never at import: ``python -m orchestrator`` imports this
    module, inside its own Hydra app, for :func:`warm_policy`."""
    key = (*base, *overrides)
    if key not in _configs:
        with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
            _configs[key] = compose("config", overrides=list(key))
    return _configs[key]


class NotComparable(ValueError):
    """The experiment's algorithm has no like-for-like setting in TRL's ``GRPOTrainer``."""


def _unlike(algo: dict[str, Any]) -> list[str]:
    """What of ``algo`` TRL's settings below cannot reproduce (empty: the comparison holds)."""
    loss, advantage = algo.get("loss") or {}, algo.get("advantage") or {}
    unlike = []
    if not str(loss.get("_target_", "")).endswith(".PPOClip"):
        unlike.append(f"algo.loss is {loss.get('_target_')}, not PPO's clip (TRL's epsilon, "
                      "epsilon_high)")
    elif loss.get("dual_clip") is not None:
        unlike.append("algo.loss.dual_clip is set (TRL has no dual clip)")
    if not str(advantage.get("_target_", "")).endswith(".GroupNorm") or \
            advantage.get("std") != "group":
        unlike.append("algo.advantage is not GroupNorm with std=group (TRL's "
                      "scale_rewards=group)")
    if algo.get("aggregation") != "token_mean":
        unlike.append(f"algo.aggregation is {algo.get('aggregation')}, not token_mean (TRL's "
                      "loss_type=dapo)")
    if algo.get("kl") is not None or algo.get("entropy_coef"):
        unlike.append("algo.kl or algo.entropy_coef is set (TRL runs beta=0, no entropy term)")
    return unlike


@dataclass(frozen=True)
class RLSettings:
    """The default experiment's RL settings that TRL is given too. The clip bounds are the
    PPO clip's (``algo.loss.eps_low`` / ``eps_high``); an algorithm TRL's settings cannot
    reproduce (another loss, a dual clip, another advantage or aggregation, a KL or entropy
    term) raises :class:`NotComparable`: the comparison would not be like for like."""

    batch_size: int
    group_size: int
    temperature: float
    max_tokens: int
    lr: float
    warmup_steps: int
    betas: tuple[float, float]
    weight_decay: float
    max_grad_norm: float
    eps_low: float
    eps_high: float

    @classmethod
    def of(cls, cfg: DictConfig) -> RLSettings:
        trainer, algo = section(cfg, "trainer"), section(cfg, "algo")
        unlike = _unlike(algo)
        if unlike:
            raise NotComparable("TRL's GRPOTrainer cannot run this experiment's algorithm like "
                                "for like: " + "; ".join(unlike))
        rollout = typed(RolloutConfig, cfg, "rollout")
        return cls(batch_size=scalar(cfg, "pipeline.batch_size"),
                   group_size=rollout.group_size, temperature=rollout.temperature,
                   max_tokens=rollout.max_tokens,
                   lr=float(trainer["lr"]), warmup_steps=int(trainer["warmup_steps"]),
                   betas=(float(trainer["betas"][0]), float(trainer["betas"][1])),
                   weight_decay=float(trainer["weight_decay"]),
                   max_grad_norm=float(trainer["max_grad_norm"]),
                   eps_low=float(algo["loss"]["eps_low"]),
                   eps_high=float(algo["loss"]["eps_high"]))


def arithmetic_spec(seed: int = 0) -> EnvSpec:
    """The default experiment's environment (its train and eval splits)."""
    return build_env(experiment(f"seed={seed}"))


# -- the shared model and tokenizer ------------------------------------------------------------


def char_tokenizer_fast() -> PreTrainedTokenizerFast:
    """:class:`CharTokenizer` as a ``PreTrainedTokenizerFast``: a word-level model over its
    vocabulary (same ids; every character is a word, unknown ones are ``?``), its special
    tokens atomic, decoding by concatenation, and a chat template that renders
    ``CharTokenizer.chat_prompt``'s layout token for token."""
    from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as RawTokenizer
    from transformers import PreTrainedTokenizerFast

    itos = [*CharTokenizer.SPECIALS, *CharTokenizer.CHARS]
    raw = RawTokenizer(models.WordLevel({s: i for i, s in enumerate(itos)}, unk_token="?"))
    raw.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    raw.decoder = decoders.Fuse()
    raw.add_special_tokens([AddedToken(s, special=True, normalized=False)
                            for s in CharTokenizer.SPECIALS])
    roles = [s for s in CharTokenizer.SPECIALS if s not in ("<pad>", "<bos>", "<end>")]
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=raw, bos_token="<bos>", eos_token="<end>",
                                        pad_token="<pad>", additional_special_tokens=roles)
    tokenizer.chat_template = (
        "{{ bos_token }}{% for message in messages %}"
        "{{ '<' + message['role'] + '>' + message['content'] + eos_token }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<assistant>' }}{% endif %}")
    return tokenizer


def warm_policy(weights: str, **tiny: Any) -> Policy:
    """``model._target_`` for the RL runs: :func:`tiny_policy` (the ``model=tiny`` node's
    arguments) with the weights in the ``model.safetensors`` file ``weights``."""
    policy = tiny_policy(**tiny)
    load_weights(policy.model, Path(weights))
    return policy


def load_weights(model: torch.nn.Module, path: Path) -> None:
    from safetensors.torch import load_file

    missing, unexpected = model.load_state_dict(load_file(str(path)), strict=False)
    if unexpected or set(missing) - {"lm_head.weight"}:  # the head is tied to the embedding
        raise ValueError(f"{path} does not fit the tiny model: missing {missing}, "
                         f"unexpected {unexpected}")


# -- the TRL run --------------------------------------------------------------------------------


async def score(spec: EnvSpec, task: Task, reply: str) -> float:
    """The reward a single-turn episode answering ``reply`` gets from the environment."""
    async with spec.make_env() as env:
        await env.reset(task)
        await env.step(reply)
        return (await env.reward()).total


def trl_side(cfg: DictConfig, weights: Path | None) -> tuple[torch.nn.Module, Any]:
    """The model TRL trains and its tokenizer: with ``weights``, the tiny model warm-started
    from them and the character tokenizer wrapped (:func:`char_tokenizer_fast`); without, a
    ``model=tiny`` experiment's freshly built tiny model (its seed's weights), or the
    experiment's checkpoint (``model=smollm2``, ``model=hf``) and its own tokenizer, whose
    chat template renders the prompts as the project's ``HFTokenizer`` does."""
    node = section(cfg, "model")
    if weights is not None or node["_target_"].endswith(".tiny_policy"):
        tiny = {k: v for k, v in node.items() if k != "_target_"}  # conf/model/tiny
        # without weights: the tiny policy as the project's run builds it (same seed, same
        # weights), what the smoke sizes train
        policy = warm_policy(str(weights), **tiny) if weights is not None else tiny_policy(**tiny)
        return policy.model, char_tokenizer_fast()
    from transformers import AutoTokenizer

    directory = checkpoint_dir(node)
    if directory is None:
        raise SystemExit("bench.peers_trl: a model built from config needs --weights")
    tokenizer = AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
    return build_policy({**node, "device": "cpu"}).model, tokenizer


def train(weights: Path | None, out: Path, steps: int, every: int, threads: int, seed: int,
          base: Sequence[str] = BASE) -> None:
    from datasets import Dataset
    from safetensors.torch import save_file
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    torch.set_num_threads(threads)
    torch.manual_seed(seed)
    cfg = experiment(f"seed={seed}", base=base)
    rl = RLSettings.of(cfg)
    spec = build_env(cfg)
    tasks = {t.id: t for t in spec.tasks("train")}
    dataset = Dataset.from_list([{"prompt": list(t.messages), "task_id": t.id}
                                 for t in tasks.values()])
    model, tokenizer = trl_side(cfg, weights)

    step_rewards: list[float] = []

    async def env_reward(completions: Sequence[list[dict[str, str]]],
                         task_id: Sequence[int], **_: Any) -> list[float]:
        rewards = [await score(spec, tasks[i], completion[-1]["content"])
                   for completion, i in zip(completions, task_id, strict=True)]
        step_rewards.append(sum(rewards) / len(rewards))
        return rewards

    records: list[dict[str, float]] = []
    snapshots: list[tuple[int, float, dict[str, torch.Tensor]]] = []

    class Clock(TrainerCallback):  # type: ignore[misc]
        started = 0.0

        def on_train_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            self.started = time.perf_counter()

        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            now = time.perf_counter() - self.started
            step = state.global_step
            records.append({"step": step - 1, "reward": step_rewards[-1], "time": now,
                            "threads": torch.get_num_threads()})
            if step % every == 0 or step == steps:
                tensors = {k: v.detach().clone() for k, v in model.state_dict().items()
                           if k != "lm_head.weight"}  # tied to the embedding
                snapshots.append((step, now, tensors))

    config = GRPOConfig(
        output_dir=str(out / "trainer"),
        max_steps=steps,
        per_device_train_batch_size=rl.batch_size,
        gradient_accumulation_steps=1,
        num_generations=rl.group_size,
        num_iterations=1,
        loss_type="dapo",
        epsilon=rl.eps_low,
        epsilon_high=rl.eps_high,
        beta=0.0,
        scale_rewards="group",
        mask_truncated_completions=False,
        temperature=rl.temperature,
        top_p=1.0,
        top_k=0,
        max_completion_length=rl.max_tokens,
        learning_rate=rl.lr,
        lr_scheduler_type="constant_with_warmup",
        warmup_steps=rl.warmup_steps,
        optim="adamw_torch",
        adam_beta1=rl.betas[0],
        adam_beta2=rl.betas[1],
        adam_epsilon=1e-8,
        weight_decay=rl.weight_decay,
        max_grad_norm=rl.max_grad_norm,
        use_cpu=True,
        bf16=False,
        fp16=False,
        activation_checkpointing=False,  # TRL's gradient_checkpointing=True, under its new name
        use_vllm=False,
        use_transformers_continuous_batching=False,
        dataloader_num_workers=0,
        report_to="none",
        save_strategy="no",
        eval_strategy="no",
        disable_tqdm=True,
        log_completions=False,
        logging_steps=10,
        seed=seed,
        data_seed=seed,
    )
    # TorchTrainer's optimiser and warm-up, exactly (see the module docstring).
    optimizer = torch.optim.AdamW(model.parameters(), lr=rl.lr, betas=rl.betas, eps=1e-8,
                                  weight_decay=rl.weight_decay)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: min(1.0, (step + 1) / max(rl.warmup_steps, 1)))
    clock = Clock()
    trainer = GRPOTrainer(model=model, reward_funcs=env_reward, args=config,
                          train_dataset=dataset, processing_class=tokenizer,
                          callbacks=[clock], optimizers=(optimizer, schedule))
    trainer.train()
    wall = records[-1]["time"]

    (out / "snapshots").mkdir(parents=True, exist_ok=True)
    with (out / "metrics.jsonl").open("w") as f:
        for record in records:
            f.write(json.dumps(record) + "\n")
    saved = []
    for step, at, tensors in snapshots:
        path = out / "snapshots" / f"step-{step}.safetensors"
        save_file(tensors, str(path))
        saved.append({"step": step, "time": at, "path": str(path)})
    (out / "summary.json").write_text(json.dumps({
        "steps": len(records), "samples": rl.batch_size * len(records), "rl_seconds": wall,
        "threads": torch.get_num_threads(), "snapshots": saved}, indent=1) + "\n")


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="TRL GRPOTrainer on an experiment's model and "
                                                 "task (bench.peers, bench.real_model).")
    parser.add_argument("--experiment", default="arithmetic",
                        help="conf/experiment/<name>: its model, task and RL settings")
    parser.add_argument("--weights", type=Path, default=None,
                        help="the warm start's model.safetensors (the tiny model's)")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--every", type=int, required=True, help="steps between weight snapshots")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("overrides", nargs="*",
                        help="more overrides of the experiment (after --), as its project run "
                             "was given (the smoke sizes' toy model)")
    args = parser.parse_args(argv)
    base = [*base_args(args.experiment), *args.overrides]
    try:
        RLSettings.of(experiment(base=base))
    except NotComparable as e:
        refuse("peers_trl", str(e))
    args.out.mkdir(parents=True, exist_ok=True)
    train(args.weights, args.out, args.steps, args.every, args.threads, args.seed, base)


if __name__ == "__main__":
    main()
