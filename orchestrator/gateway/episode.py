"""One agent episode as the gateway records it: every call's tokens, in segments.

Token in, token out, as in the episode runner (:mod:`orchestrator.episodes.rollout`): a segment's
sequence is the rendered prompt, then exactly the ids the engine sampled (trained, with their
behaviour log-probs and versions), then the ids the next call's new messages add (masked),
and so on. Nothing the engine produced is encoded again.

Which call extends which segment is decided on messages, not text: a chat call extends a
segment when its messages are that segment's messages — the conversation so far, ending with
the assistant message this gateway itself returned — followed by new ones, and it offers the
same tools; the new messages' continuation ids (:meth:`Tokenizer.chat_prompt` with
``continuation=True``) are appended. Anything else — the program trimmed, summarised, edited
or branched its history, changed its tools, or resent a call — starts a new segment from the
full rendered prompt. (A ``/v1/completions`` call extends a segment when its prompt text, or
its token ids, begin with the segment's prompt and completion.) If the extended turn did not
end with a stop token (cut by ``max_tokens`` or a ``stop`` string) the stop token the chat
format puts there is appended first, as context. Each segment is trained as its own sample
with the episode's reward; ``n`` > 1 forks one segment per choice.

Spans: each call is a ``generate`` span, and the time from one call's answer to the call that
extends it is a ``tool_call`` span named ``agent`` (the program's tools and its own work), so
PolyTrace turns and tool calls come out as for a built-in environment.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import anyio

from envs.agent import AgentEndpoint, AgentOutcome
from envs.base import Message, StepResult, ToolCallRecord
from envs.parsers import make_parser
from orchestrator.engines.base import InferenceEngine
from orchestrator.episodes.trajectory import TrajectoryBuilder
from orchestrator.gateway.protocol import (
    BadRequest,
    ChatRequest,
    Choice,
    CompletionRequest,
    Sampling,
    as_message,
    assistant_message,
)
from orchestrator.models.tokenizer import Tokenizer
from orchestrator.trace.episode import EpisodeTrace
from orchestrator.trace.recorder import Recorder
from orchestrator.types import EpisodeTiming, FinishReason, Generation, SamplingParams, Trajectory

AGENT_TOOL = "agent"  # the name of the span between two calls of one segment


@dataclass(frozen=True)
class EpisodeLimits:
    """What bounds one episode's calls (from the agent env and the run's rollout settings)."""

    temperature: float
    max_tokens: int  # per call: a request's max_tokens is capped here
    max_context: int | None  # a prompt of this many tokens is refused (400)
    max_total_tokens: int | None  # a segment's whole sequence
    max_calls: int
    top_p: float = 1.0  # the run's truncation of the distribution (rollout's, or the eval's)
    top_k: int = 0


@dataclass
class _Segment:
    builder: TrajectoryBuilder
    trace: EpisodeTrace
    key: Any  # chat: (messages, tools) so far; completions: the prompt and completion so far
    chat: bool = True
    last: Generation | None = None  # the last call's generation
    answered_at: float = 0.0  # clock reading when the last call was answered
    busy: bool = False  # a call is generating on it
    dead: bool = False  # a call on it failed or was cancelled: it takes no more
    turn_open: bool = False  # the last generation's turn is not yet in the trace
    turns: int = 0
    max_new: int = 0
    text_tokens: int = 0

    def extendable(self) -> bool:
        return self.last is not None and not (self.busy or self.dead)

    def fork(self) -> _Segment:
        trace = copy.copy(self.trace)
        trace.turns, trace.tool_calls = list(self.trace.turns), list(self.trace.tool_calls)
        return replace(self, builder=copy.deepcopy(self.builder), trace=trace)


@dataclass
class Reply:
    """What one call produced, for the response writer."""

    choices: list[Choice]
    messages: list[dict[str, Any]]  # chat: the assistant messages
    prompt_tokens: int
    completion_tokens: int
    engine_s: float = 0.0  # of the call's time, what it waited on the engine


@dataclass
class AgentEpisode:
    """One episode's key, its segments and its calls. Built by the gateway."""

    endpoint: AgentEndpoint
    engine: InferenceEngine
    tokenizer: Tokenizer
    recorder: Recorder
    limits: EpisodeLimits
    worker: str
    sample: int
    segments: list[_Segment] = field(default_factory=list)
    calls: int = 0
    closed: bool = False
    _inflight: set[anyio.CancelScope] = field(default_factory=set)

    # -- calls -----------------------------------------------------------------------------

    async def chat(self, request: ChatRequest) -> Reply:
        found = self._find(lambda s: s.chat and s.key[1] == request.tools
                           and _continues_chat(request.messages, s.key[0]))
        if found is not None:
            new = request.messages[len(found.key[0]):]
            ids = self._closing(found) + self.tokenizer.chat_prompt(new, continuation=True)
        else:
            new = ()
            try:
                ids = self.tokenizer.chat_prompt(request.messages, tools=request.tools or None)
            except ValueError as e:
                raise BadRequest(f"the messages cannot be rendered: {e}", "messages") from e
        branches = self._admit(found, ids, request.sampling, "messages", new, chat=True)
        prompt = len(branches[0].builder)
        started = self.recorder.now()
        choices = await self._generate(branches, request.sampling, request.parse_tools)
        engine_s = self.recorder.now() - started
        messages = [assistant_message(c) for c in choices]
        for segment, message in zip(branches, messages, strict=True):
            segment.key = ((*request.messages, as_message(message)), request.tools)
        return self._reply(branches, choices, messages, prompt, engine_s)

    async def complete(self, request: CompletionRequest) -> Reply:
        text = request.prompt
        found = self._find(lambda s: not s.chat and type(s.key) is type(text)
                           and len(text) > len(s.key) and text[:len(s.key)] == s.key)
        tail = text[len(found.key):] if found is not None else text
        if isinstance(tail, str):
            ids = self.tokenizer.encode(tail)
        else:
            ids = list(tail)
            if any(t >= self.tokenizer.vocab_size for t in ids):
                raise BadRequest(f"token ids must be below the vocabulary size "
                                 f"{self.tokenizer.vocab_size}", "prompt")
        branches = self._admit(found, ids, request.sampling, "prompt", (), chat=False)
        prompt = len(branches[0].builder)
        started = self.recorder.now()
        choices = await self._generate(branches, request.sampling, parse_tools=False)
        engine_s = self.recorder.now() - started
        for segment, choice in zip(branches, choices, strict=True):
            assert segment.last is not None
            segment.key = text + (choice.text if isinstance(text, str) else segment.last.token_ids)
        return self._reply(branches, choices, [], prompt, engine_s)

    # -- segments ----------------------------------------------------------------------------

    def _find(self, matches: Callable[[_Segment], bool]) -> _Segment | None:
        """The newest segment this call extends, if any."""
        for segment in reversed(self.segments):
            if segment.extendable() and matches(segment):
                return segment
        return None

    def _closing(self, segment: _Segment) -> list[int]:
        """A stop token, as context, when the segment's last turn did not end with one."""
        last, stops = segment.last, self.tokenizer.stop_ids
        if last is not None and last.token_ids and last.token_ids[-1] in stops:
            return []
        return [stops[0]]

    def _admit(self, found: _Segment | None, ids: list[int], sampling: Sampling, param: str,
               new_messages: Sequence[Message], chat: bool) -> list[_Segment]:
        """Check the call against the limits, then commit it: extend ``found`` by ``ids`` or
        open a segment on them; one branch per choice. Nothing is recorded for a refused call."""
        limits = self.limits
        if self.closed:
            raise BadRequest("this episode has ended", status=401, code="invalid_api_key")
        if self.calls >= limits.max_calls:
            raise BadRequest(f"this episode has made its {limits.max_calls} calls (env.max_calls)")
        length = (len(found.builder) if found is not None else 0) + len(ids)
        if limits.max_context is not None and length >= limits.max_context:
            raise BadRequest(f"the prompt is {length} tokens; the context holds "
                             f"{limits.max_context} (a reply needs at least one more)", param)
        if limits.max_total_tokens is not None and length >= limits.max_total_tokens:
            raise BadRequest(f"the episode's sequence would be {length} tokens; "
                             f"rollout.max_total_tokens is {limits.max_total_tokens}", param)
        self.calls += 1
        if found is None:
            segment = _Segment(TrajectoryBuilder(), EpisodeTrace(
                self.recorder, self.worker, self.sample, self.tokenizer), key=None, chat=chat)
            segment.builder.add_prompt(ids)
            self.segments.append(segment)
        else:
            segment = found
            gap = ToolCallRecord(AGENT_TOOL, "ok", segment.answered_at,
                                 self.recorder.clock() - segment.answered_at)
            self._end_turn(segment, StepResult(tuple(new_messages), 0.0, False,
                                               tool_calls=(gap,)), len(ids))
            segment.builder.add_observation(ids)
        segment.busy = True
        branches = [segment] + [segment.fork() for _ in range(sampling.n - 1)]
        self.segments += branches[1:]
        return branches

    def _end_turn(self, segment: _Segment, result: StepResult, appended: int | None) -> None:
        if segment.last is not None and segment.turn_open:
            segment.trace.turn(segment.last, result, segment.max_new, segment.text_tokens,
                               appended)
            segment.turn_open = False

    async def _generate(self, branches: list[_Segment], sampling: Sampling,
                        parse_tools: bool) -> list[Choice]:
        limits = self.limits
        length = len(branches[0].builder)
        max_tokens = min(sampling.max_tokens or limits.max_tokens, limits.max_tokens)
        for cap in (limits.max_context, limits.max_total_tokens):
            if cap is not None:
                max_tokens = min(max_tokens, cap - length)
        params = SamplingParams(max_tokens=max_tokens, temperature=limits.temperature,
                                stop_token_ids=self.tokenizer.stop_ids, seed=sampling.seed,
                                top_p=limits.top_p, top_k=limits.top_k)
        choices: list[Choice] = [None] * len(branches)  # type: ignore[list-item]

        async def one(i: int, segment: _Segment) -> None:
            ids = segment.builder.ids
            gen = await segment.trace.generate(segment.turns, self.engine.version, len(ids),
                                               self.engine.generate(ids, params))
            gen = self._cut_at_stop(gen, sampling.stop)
            segment.builder.add_generation(gen)
            choices[i] = self._choice(gen, sampling, parse_tools)
            segment.last, segment.max_new, segment.turn_open = gen, max_tokens, True
            segment.text_tokens = choices[i].text_tokens

        scope = anyio.CancelScope()
        self._inflight.add(scope)
        completed = False
        try:
            with scope:
                async with anyio.create_task_group() as tg:
                    for i, segment in enumerate(branches):
                        tg.start_soon(one, i, segment)
                completed = True
        finally:
            self._inflight.discard(scope)
            now = self.recorder.clock()
            for segment in branches:
                segment.busy, segment.turns, segment.answered_at = False, segment.turns + 1, now
                segment.dead = segment.dead or not completed
        if not completed:
            raise BadRequest("this episode ended while the call was generating", status=401,
                             code="invalid_api_key")
        return choices

    def _cut_at_stop(self, gen: Generation, stops: Sequence[str]) -> Generation:
        """``gen`` up to the token that completes the first ``stop`` string (the engines stop
        on token ids only); the tokens sampled after it are dropped, not trained."""
        if not stops:
            return gen
        text = ""
        for i, token in enumerate(gen.token_ids):
            text += self.tokenizer.decode([token])
            if any(s in text for s in stops):
                keep = i + 1
                return replace(gen, token_ids=gen.token_ids[:keep], logprobs=gen.logprobs[:keep],
                               versions=gen.versions[:keep], finish_reason=FinishReason.STOP)
        return gen

    def _choice(self, gen: Generation, sampling: Sampling, parse_tools: bool) -> Choice:
        stops = self.tokenizer.stop_ids
        kept = [i for i, t in enumerate(gen.token_ids) if t not in stops]
        if sampling.logprobs:
            tokens = tuple(self.tokenizer.decode([gen.token_ids[i]]) for i in kept)
            logprobs = tuple(gen.logprobs[i] for i in kept)
            text = "".join(tokens)
        else:
            tokens, logprobs = (), ()
            text = self.tokenizer.decode([gen.token_ids[i] for i in kept])
        for stop in sampling.stop:  # OpenAI leaves the stop string out of the text
            at = text.find(stop)
            if at >= 0:
                text = text[:at]
        parsed = make_parser(self.tokenizer.tool_format).parse(text) if parse_tools else None
        if gen.finish_reason is FinishReason.LENGTH:
            finish = "length"
        elif parsed is not None and parsed.calls and not parsed.errors:
            finish = "tool_calls"
        else:
            finish = "stop"
        return Choice(text, finish, parsed, tokens, logprobs, text_tokens=len(kept))

    @staticmethod
    def _reply(branches: list[_Segment], choices: list[Choice], messages: list[dict[str, Any]],
               prompt: int, engine_s: float) -> Reply:
        completion = sum(len(s.last.token_ids) for s in branches if s.last is not None)
        return Reply(choices, messages, prompt, completion, engine_s)

    # -- the end -----------------------------------------------------------------------------

    def close(self) -> bool:
        """End the episode: no call is accepted any more, and calls still generating are
        cancelled (their callers get 401). True if some call was still in flight."""
        self.closed = True
        inflight = bool(self._inflight)
        for scope in self._inflight:
            scope.cancel()
        return inflight

    @property
    def generated_segments(self) -> int:
        return sum(s.last is not None for s in self.segments)

    def trajectories(self, outcome: AgentOutcome, prompt_id: int, metrics: dict[str, float],
                     numbers: Iterator[int]) -> list[tuple[Trajectory, EpisodeTiming]]:
        """Each segment that generated something, as a sample with the episode's reward (its
        sample index the next of ``numbers``) and its timing."""
        end = {"ok": "done", "error": "agent_error", "timeout": "agent_timeout"}[outcome.status]
        out = []
        for segment in self.segments:
            if segment.last is None:
                continue
            self._end_turn(segment, StepResult((), 0.0, True), None)
            trajectory = segment.builder.build(
                prompt_id=prompt_id, sample_index=next(numbers),
                reward=outcome.reward.total, version=self.engine.version, end_reason=end,
                max_tokens=self.limits.max_tokens, metrics=dict(metrics),
                reward_terms=outcome.reward.terms)
            out.append((trajectory, segment.trace.finish()))
        return out


def _continues_chat(messages: Sequence[Message], previous: Sequence[Message]) -> bool:
    return len(messages) > len(previous) and tuple(messages[:len(previous)]) == tuple(previous)
