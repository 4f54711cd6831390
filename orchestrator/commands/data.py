"""``python -m orchestrator.data``: a user's dataset files, and a reward on them, checked
before a run.

* ``check PATH… [key=value …]``: per file, its rows, the fields found and how they map
  (the schema, the prompt and answer columns, where each row's source comes from, the
  metadata columns), the rows per source, and its prompts' lengths in the model's tokens
  (min / median / max, and how many a run would leave out: over the context less
  ``rollout.max_tokens``, the run's own rule, :func:`orchestrator.builders.prompt_budget`); then
  the duplicate prompts (a row repeating one of its own file, one repeating another file's,
  and with ``env.eval=…`` train rows that are also eval prompts) and the first row rendered
  through the model's chat template, special tokens written out. A glob is its files.
* ``score DATA --completions FILE [--reward NAME] [key=value …]``: FILE is a JSONL of
  completions, one per row of DATA in order (field ``completion``: a string, or messages
  whose last assistant content is taken); each is scored with ``env.reward`` (or
  ``--reward``: a name, or a YAML list or mapping as ``env.reward`` takes) through the
  environment's own episode and :class:`~envs.rewards.Scorer` (worker processes under
  ``env.reward_timeout_s``) as a run scores it. Prints each row's score (with each term's
  when there are several), the timeouts and errors, and last ``mean_reward=<value>``.

Both compose the real ``conf/`` as ``python -m orchestrator`` does, with ``env=dataset``
and the overrides given (``model=smollm2``, ``env.prompt_key=…``, ``env.eval=…``,
``rollout.max_tokens=…``, ``experiment=…``); an argument that exists as a file is a path,
one of the form ``key=value`` an override. Files are read and checked by
:mod:`envs.dataset`, one :class:`~envs.dataset.DatasetSpec` per file, so a bad file does not
hide the others: ``check`` reports it among the files (its bad rows named by file, row and
key: the first 20 and their count) and exits 1. Any other mistake (no such option, an unknown
reward, a completions file whose row count is not DATA's) is one line, ``error: …``, exit code 2.

Limits: every row is built and tokenised one at a time, as the run's length filter does: a
file of a million rows takes minutes with a Hugging Face tokenizer. Duplicates are found by
a hash of each prompt's messages as the model gets them. A mixture's weights are not read
(``env.train`` must be paths here): check its files, which are what can go wrong.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import statistics
import sys
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from envs.base import Message, Reward
from envs.dataset import DatasetSpec
from envs.dataset_files import BadRows, DatasetTask
from envs.errors import EnvConfigError
from envs.reward_functions import Term, parse_reward
from orchestrator.config.read import CONF, check_target, explain, section, typed
from orchestrator.models.tokenizer import Tokenizer

Print = Callable[[str], None]
_OVERRIDE = re.compile(r"^[+~]{0,2}[A-Za-z_][\w.@/-]*=")
SCORING = 16  # episodes scored at once: more than the Scorer's waiting threads (4 a worker)


class BadInput(Exception):
    """A mistake of the command line's: one line, exit code 2."""


# --- the config ---------------------------------------------------------------------------------


def compose_config(overrides: Sequence[str]) -> DictConfig:
    """The real ``conf/`` with ``env=dataset`` (unless ``env=`` is given) and ``overrides``."""
    from hydra import compose, initialize_config_dir

    names = {o.split("=", 1)[0].lstrip("+~") for o in overrides}
    base = [] if "env" in names else ["env=dataset"]
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose("config", overrides=[*base, *overrides], return_hydra_config=True)


def split_arguments(items: Sequence[str]) -> tuple[list[str], list[str]]:
    """Paths and ``key=value`` overrides (an existing file is a path whatever its name)."""
    paths, overrides = [], []
    for item in items:
        (overrides if _OVERRIDE.match(item) and not os.path.exists(item) else paths).append(item)
    return paths, overrides


def env_settings(cfg: DictConfig) -> dict[str, Any]:
    """``cfg.env``'s keyword arguments for a :class:`DatasetSpec`, type-checked (``train``
    None where the config leaves it to be given)."""
    node = OmegaConf.select(cfg, "env")
    target = OmegaConf.select(cfg, "env._target_")
    if node is None or target != f"{DatasetSpec.__module__}.{DatasetSpec.__qualname__}":
        raise BadInput(f"this command reads env=dataset's files; env._target_ is {target}")
    values: dict[str, Any] = OmegaConf.to_container(node, resolve=True)  # type: ignore[assignment]
    if values.get("train") == "???":
        values["train"] = None
    check_target(OmegaConf.create({"env": values}), "env")
    del values["_target_"]
    return values


def files_of(value: object, key: str) -> list[str]:
    """The files ``env.train`` / ``env.eval`` name (paths or globs; a glob is its files in
    sorted order, or itself when nothing matches, for the dataset module to report)."""
    if value is None:
        return []
    items = [value] if isinstance(value, (str, os.PathLike)) else value
    if not isinstance(items, Sequence) or not all(isinstance(v, (str, os.PathLike)) for v in items):
        raise BadInput(f"{key} must be paths or globs here (check a mixture's files one by one), "
                       f"got {value!r}")
    files: list[str] = []
    for item in map(str, items):
        pattern = os.path.expanduser(item)
        files += (sorted(glob.glob(pattern)) or [item]) if glob.has_magic(pattern) else [item]
    return files


def read_file(path: str, env: Mapping[str, Any]) -> DatasetSpec:
    """One file through the dataset module's reader and checks (EnvConfigError: its line)."""
    return DatasetSpec(**{**env, "train": path, "eval": None})


# --- check --------------------------------------------------------------------------------------


@dataclass
class FileReport:
    split: str
    path: str
    error: str | None = None
    bad_rows: list[str] = field(default_factory=list)  # the first SHOWN bad rows' lines
    bad_count: int = 0  # all of them
    mapping: str = ""
    sources: Counter[str] = field(default_factory=Counter)
    lengths: list[int] = field(default_factory=list)
    keys: list[int] = field(default_factory=list)  # each row's prompt, hashed
    first: tuple[Message, ...] | None = None

    @property
    def name(self) -> str:
        return f"{self.split} {self.path}"


def describe_fields(spec: DatasetSpec, env: Mapping[str, Any]) -> str:
    """How a file's columns map: schema, prompt, answer, source, metadata."""
    segment = next(iter(spec.splits["train"].segments()))  # type: ignore[attr-defined]
    head = segment.prompt_key.split(".")[0]
    value: Any = segment.data[0]
    for part in segment.prompt_key.split("."):
        value = value[part]
    messages = not isinstance(value, str)
    if env.get("prompt_key") or env.get("answer_key"):
        schema = "keys set by env.prompt_key / env.answer_key"
    elif segment.answer_key == "reward_model.ground_truth" and messages:
        schema = "verl schema"
    elif head in ("prompt", "messages"):
        schema = "TRL schema"
    else:
        schema = "plain schema"
    source = "its 'data_source' column" if segment.source is None else \
        f"the file's name ({segment.source})"
    metadata = ", ".join(c for c in segment.data.column_names if c != head) or "none"
    kind = "messages" if messages else "a string"
    answer = f"'{segment.answer_key}'" if segment.answer_key is not None else \
        "each conversation's last turn (the assistant's)"
    return (f"{schema}: prompt <- '{segment.prompt_key}' ({kind}), answer <- {answer}, "
            f"source <- {source}; metadata: {metadata}")


def prompt_key(messages: Sequence[Message]) -> int:
    return hash(tuple((m["role"], m["content"]) for m in messages))


def read_report(split: str, path: str, env: Mapping[str, Any], tokenizer: Tokenizer) -> FileReport:
    report = FileReport(split, path)
    try:
        spec = read_file(path, env)
    except BadRows as e:
        rename = f"env.{split}: "
        report.bad_rows = [e.line(p).replace("env.train: ", rename, 1) for p in e.problems]
        report.bad_count = e.count
        report.error = report.bad_rows[0]
        return report
    except EnvConfigError as e:
        report.error = str(e).replace("env.train: ", f"env.{split}: ", 1)
        return report
    report.mapping = describe_fields(spec, env)
    for task in spec.tasks("train"):
        assert isinstance(task, DatasetTask)
        try:
            report.lengths.append(len(tokenizer.chat_prompt(task.messages)))
        except ValueError as e:  # the chat format refuses it (a role it has no token for)
            report.error = (f"env.{split}: {path} row {task.row} key 'prompt': the chat "
                            f"template cannot render it: {e}")
            return report
        report.keys.append(prompt_key(task.messages))
        report.sources[task.source] += 1
        if report.first is None:
            report.first = task.messages
    return report


def lengths_line(lengths: Sequence[int], budget: int | None) -> str:
    text = (f"prompt tokens min {min(lengths)}, median {statistics.median(lengths):g}, "
            f"max {max(lengths)}")
    if budget is not None:
        text += f"; left out (over {budget}): {sum(n > budget for n in lengths)}"
    return text


def check(items: Sequence[str], out: Print = print) -> int:
    # the run's modules (torch): here, so that score starts in a moment
    from orchestrator.builders import prompt_budget
    from orchestrator.config.schema import RolloutConfig
    from orchestrator.models.policy import build_tokenizer, model_context

    paths, overrides = split_arguments(items)
    cfg = compose_config(overrides)
    env = env_settings(cfg)
    train = files_of(paths or env["train"], "PATH" if paths else "env.train")
    if not train:
        raise BadInput("name the files to check: python -m orchestrator.data check PATH… "
                       "[key=value …]")
    check_target(cfg, "model")
    rollout = typed(RolloutConfig, cfg, "rollout")
    model = section(cfg, "model")
    tokenizer = build_tokenizer(model)
    limits = prompt_budget(rollout, model_context(model))
    budget = limits[1] if limits else None
    choice = OmegaConf.select(cfg, "hydra.runtime.choices.model") or model["_target_"]
    if limits is None:
        out(f"model={choice}: {type(tokenizer).__name__}; its context is unknown (set "
            "rollout.max_total_tokens): a run checks no prompt's length")
    else:
        out(f"model={choice}: {type(tokenizer).__name__}, context {limits[0]} tokens, "
            f"rollout.max_tokens={rollout.max_tokens}: a prompt may have {budget} tokens")

    reports = [read_report("train", f, env, tokenizer) for f in train]
    reports += [read_report("eval", f, env, tokenizer) for f in files_of(env["eval"], "env.eval")]
    for report in reports:
        if report.bad_count > 1:
            shown = len(report.bad_rows)
            out(f"{report.name}: error: {report.bad_count} bad rows"
                + (f" (the first {shown} here)" if shown < report.bad_count else ""))
            for line in report.bad_rows:
                out(f"  {line}")
            continue
        if report.error is not None:
            out(f"{report.name}: error: {report.error}")
            continue
        out(f"{report.name}: {len(report.lengths)} rows")
        out(f"  fields: {report.mapping}")
        out("  sources: " + ", ".join(f"{s} {n}" for s, n in sorted(report.sources.items())))
        out(f"  {lengths_line(report.lengths, budget)}")

    good = [r for r in reports if r.error is None]
    for split in ("train", "eval"):
        ours = [r for r in good if r.split == split]
        if not ours:
            continue
        lengths = [n for r in ours for n in r.lengths]
        sources: Counter[str] = sum((r.sources for r in ours), Counter())
        out(f"{split}: {len(ours)} file{'s' * (len(ours) > 1)}, {len(lengths)} rows; sources: "
            + ", ".join(f"{s} {n}" for s, n in sorted(sources.items())))
        out(f"  {lengths_line(lengths, budget)}")
        if split == "train" and budget is not None and all(n > budget for n in lengths):
            out("  every train prompt is too long: the run would stop before training")
    out(duplicates_line(good))
    first = next((r for r in good if r.split == "train"), None)
    if first is not None and first.first is not None:
        ids = tokenizer.chat_prompt(first.first)
        out(f"first row of {first.path}, through the chat template ({len(ids)} tokens):")
        for line in tokenizer.render(ids).splitlines() or [""]:
            out(f"  {line}")
    bad = len(reports) - len(good)
    if bad:
        out(f"{bad} of {len(reports)} files cannot be read as they are: a run would stop "
            "on the first")
        return 1
    return 0


def _rows(n: int, one: str, many: str) -> str:
    return f"{n} train row {one}" if n == 1 else f"{n} train rows {many}"


def duplicates_line(reports: Sequence[FileReport]) -> str:
    """Train rows repeating an earlier train row's prompt (of their own file, of another
    file), and train rows whose prompt is an eval row's."""
    seen: dict[int, tuple[str, int]] = {}
    same = other = 0
    example = ""
    for report in (r for r in reports if r.split == "train"):
        for row, key in enumerate(report.keys, 1):
            if key not in seen:
                seen[key] = (report.path, row)
                continue
            path, earlier = seen[key]
            if path == report.path:
                same += 1
            else:
                other += 1
            example = example or (f" (first: {report.path} row {row} repeats "
                                  f"{'' if path == report.path else path + ' '}row {earlier})")
    repeated = _rows(same + other, "repeats", "repeat")
    text = (f"duplicate prompts: {repeated} an earlier one{example}: {same} within a file, "
            f"{other} between files")
    evals = {k for r in reports if r.split == "eval" for k in r.keys}
    if evals:
        shared = sum(k in evals for r in reports if r.split == "train" for k in r.keys)
        text += f"; {_rows(shared, 'is also an eval prompt', 'are also eval prompts')}"
    return text


# --- score --------------------------------------------------------------------------------------


def read_completions(path: str) -> list[str]:
    """A JSONL of ``{"completion": …}`` rows (a string, or messages: the last assistant's)."""
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as e:
        raise BadInput(f"--completions: cannot read {path}: {e.strerror or e}") from e
    completions = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise BadInput(f"--completions: {path} line {n} is not JSON: {e.msg}") from e
        value = row.get("completion") if isinstance(row, dict) else None
        if isinstance(value, list):
            said = [m.get("content") for m in value
                    if isinstance(m, dict) and m.get("role") == "assistant"]
            value = said[-1] if said else None
        if not isinstance(value, str):
            raise BadInput(f"--completions: {path} line {n} has no 'completion' string "
                           "(a string, or messages with an assistant's)")
        completions.append(value)
    return completions


async def score_rows(spec: DatasetSpec, completions: Sequence[str]) -> list[Reward]:
    """Each row's completion scored as a run scores an episode's reply (the env's own
    episode, its Scorer), ``SCORING`` at a time."""
    import anyio

    tasks = spec.tasks("train")
    rewards: list[Reward | None] = [None] * len(completions)
    rows = iter(range(len(completions)))

    async def worker() -> None:
        for i in rows:
            env = spec.make_env()
            try:
                await env.reset(tasks[i])
                await env.step(completions[i])
                rewards[i] = await env.reward()
            finally:
                await env.aclose()

    async with spec.running(), anyio.create_task_group() as group:
        for _ in range(SCORING):
            group.start_soon(worker)
    return [r for r in rewards if r is not None]


def score(data: str, completions_path: str, reward: str | None, overrides: Sequence[str],
          out: Print = print) -> int:
    import anyio
    import yaml

    cfg = compose_config(overrides)
    env = env_settings(cfg)
    if reward is not None and reward.lstrip()[:1] in ("[", "{"):  # a list or weighted sum
        try:
            env["reward"] = yaml.safe_load(reward)
        except yaml.YAMLError as e:
            raise BadInput(f"--reward {reward} is neither a name nor a YAML list or mapping "
                           "such as '{math: 1.0, format: 0.1}'") from e
    elif reward is not None:
        env["reward"] = reward
    completions = read_completions(completions_path)
    files = files_of(data, "DATA")
    spec = DatasetSpec(**{**env, "train": files if len(files) > 1 else files[0], "eval": None})
    count = len(spec.tasks("train"))
    if len(completions) != count:
        raise BadInput(f"{completions_path} has {len(completions)} completions and {data} has "
                       f"{count} rows: one completion per row, in order")
    rewards = anyio.run(score_rows, spec, completions)
    for n, value in enumerate(rewards, 1):
        parts = "" if len(value.components) < 2 else "  " + " ".join(
            f"{name}={part:g}" for name, part in value.components.items())
        out(f"row {n}: {value.total:g}{parts}")
    counters = spec.metrics()
    routes = parse_reward(env["reward"])

    def sum_of(terms: Sequence[Term]) -> str:
        return " + ".join(t.name if t.weight == 1 else f"{t.weight:g} {t.name}" for t in terms)

    terms = sum_of(routes.default) if not routes.by_source else ", ".join(
        [*(f"{source}: {sum_of(t)}" for source, t in routes.by_source.items()),
         f"default: {sum_of(routes.default)}"])
    out(f"reward {terms}: {count} rows, {counters['reward/timeouts']:g} timed out, "
        f"{counters['reward/errors']:g} errors (each scored 0)")
    out(f"mean_reward={sum(r.total for r in rewards) / count:.4f}")
    return 0


# --- the command line ---------------------------------------------------------------------------


USAGE = ("usage: python -m orchestrator.data check PATH… [key=value …]\n"
         "       python -m orchestrator.data score DATA --completions FILE [--reward NAME] "
         "[key=value …]")


def parsers() -> dict[str, argparse.ArgumentParser]:
    check_ = argparse.ArgumentParser(
        prog="python -m orchestrator.data check",
        description="Rows, fields, prompt lengths, duplicates and the first row of your files.")
    check_.add_argument("items", nargs="*", metavar="PATH or key=value",
                        help="files or globs, and config overrides (model=smollm2, env.…=…)")
    score_ = argparse.ArgumentParser(
        prog="python -m orchestrator.data score",
        description="Score a JSONL of completions, one per row of DATA, with the reward.")
    score_.add_argument("data", metavar="DATA", help="the dataset file (or glob)")
    score_.add_argument("--completions", required=True, metavar="FILE",
                        help="JSONL, one {\"completion\": …} per row of DATA, in order")
    score_.add_argument("--reward", metavar="NAME", help="default: the config's env.reward")
    score_.add_argument("overrides", nargs="*", metavar="key=value")
    return {"check": check_, "score": score_}


def main(argv: Sequence[str] | None = None, out: Print = print) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    commands = parsers()
    if not args or args[0] not in commands:
        help_asked = args[:1] in (["-h"], ["--help"])
        print(f"{USAGE}\n\n{__doc__}" if help_asked else USAGE,
              file=sys.stdout if help_asked else sys.stderr)
        return 0 if help_asked else 2
    parsed = commands[args[0]].parse_intermixed_args(args[1:])
    try:
        if args[0] == "check":
            return check(parsed.items, out)
        return score(parsed.data, parsed.completions, parsed.reward, parsed.overrides, out)
    except (BadInput, EnvConfigError) as error:
        message: str | None = str(error)
    except (Exception, BaseExceptionGroup) as error:  # re-raised unless explained
        message = explain(error)
        if message is None:
            raise
    print(f"error: {message}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
