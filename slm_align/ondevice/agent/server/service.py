"""What the routes share: the model, its thread, the store, the server's tools and limits, its
adapter sets; answering on the thread."""

from __future__ import annotations

import json
import threading
import uuid
from contextlib import contextmanager
from dataclasses import dataclass, field, fields, replace
from typing import Iterator, Optional, Union

from slm_align.ondevice.agent.batching import Engine
from slm_align.ondevice.agent.llama_backend import LlamaCppBackend
from slm_align.ondevice.agent.llama_batch import LlamaBatchDecoder
from slm_align.ondevice.agent.loading import Model
from slm_align.ondevice.agent.runtime import Agent, record_feedback
from slm_align.ondevice.agent.server.adapters import AdapterRouter, AdapterSet
from slm_align.ondevice.agent.server.body import Limits
from slm_align.ondevice.agent.server.chat_request import ChatRequest
from slm_align.ondevice.agent.server.errors import ApiError, bad
from slm_align.ondevice.agent.server.feedback_body import FeedbackBody
from slm_align.ondevice.agent.server.worker import ModelWorker
from slm_align.ondevice.agent.settings import SamplingParams
from slm_align.ondevice.agent.store import PreferenceStore, Turn
from slm_align.ondevice.tools.registry import ToolRegistry


@dataclass
class Outcome:
    """How a chat request ended: the last item of a chat job."""

    content: Optional[str]
    """The answer text (without tool-call blocks when the client's tools were called)."""
    tool_calls: list = field(default_factory=list)
    """OpenAI-shaped calls for the client to run."""
    finish_reason: str = "stop"
    """stop, length or tool_calls."""
    turn_id: Optional[int] = None
    """The turn's id in the preference store (None without a store)."""
    turn_token: Optional[str] = None
    """What feedback on the turn must present (None without a store)."""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    streamed: bool = True
    """The content already went out piece by piece (False: it was held back
    to look for tool calls)."""
    logprobs: Optional[list] = None
    """OpenAI's ``logprobs.content`` when the request asked for ``logprobs``."""


DEFAULT_BATCH = 8
"""Requests decoded together by default (``serve --batch``)."""


class Service:
    """Everything the routes share: the model, its threads, the store, the
    server-side tools and the limits.

    With ``batch`` > 1, a GGUF model and one adapter set, up to ``batch`` requests decode together:
    each runs on a worker thread of its own, on a lane of a batched llama.cpp engine
    (:mod:`slm_align.ondevice.agent.batching`); otherwise one model thread answers them in turn, as before
    (ONNX, and adapter sets or an A/B test: llama.cpp applies adapters to a whole context)."""

    def __init__(self, model: Model, store: Optional[PreferenceStore], consent: bool,
                 tools: Optional[ToolRegistry], limits: Limits, router: Optional[AdapterRouter] = None,
                 batch: int = 1, call_threshold: Optional[float] = None):
        self.model = model
        self.store = store
        self.consent = consent
        self.tools = tools
        self.limits = limits
        self.call_threshold = call_threshold
        """The call rule on every reply that may call (see :mod:`~slm_align.ondevice.agent.call_rule`)."""
        self.router = router or AdapterRouter(model)
        """The adapter sets and which one answers each request."""
        self.engine: Optional[Engine] = None
        """The batched engine requests decode on (None: the model's backend, one request at a time)."""
        if batch > 1 and isinstance(model.backend, LlamaCppBackend) and len(self.router.sets) == 1:
            # prompts first: a new request's first token waits for its prompt, not for a step of
            # every running request (p95 time to first token 8.1x -> 5.9x one client's, 8 clients)
            self.engine = Engine(LlamaBatchDecoder(model.backend, batch), prompts_first=True)
        self.worker = ModelWorker(limits.max_queue, workers=batch if self.engine else 1)

    @contextmanager
    def lease(self, logits: bool = False) -> Iterator:
        """The backend a job decodes on: a lane of the engine (its slot freed when the job ends,
        is cancelled or fails), or the model's backend; ``logits``: its draws keep their logits."""
        if self.engine is None:
            yield self.model.backend
            return
        with self.engine.lane() as lane:
            lane.want_logits = logits
            yield lane

    def choose(self, chat: ChatRequest, client: str = "") -> AdapterSet:
        """The adapter set that answers ``chat`` (a 400 for an unknown ``model``); a request without a
        conversation id this server signed gets a new one first (routing goes by it)."""
        chat.conversation_id = self.router.conversation(chat.conversation_id)
        chat.client = client
        chat.arm = self.router.routed_arm(chat.model, chat.conversation_id)
        return self.router.pick(chat.model, chat.conversation_id)

    # chat (on the model thread)
    def answer(self, chat: ChatRequest, chosen: AdapterSet, cancel: threading.Event) -> Iterator[Union[str, Outcome]]:
        """Text pieces of the answer by the ``chosen`` adapter set (unless held back for client tools),
        then its :class:`Outcome`; generation stops at the next token once ``cancel`` is set."""
        with self.lease(logits=chat.logprobs is not None) as backend:
            self.router.apply(chosen)
            agent = self._agent(chat, cancel, backend)
            held_back = chat.client_tools is not None
            for piece in agent.respond(chat.messages):
                if not held_back:
                    yield piece
        reply = agent.last
        outcome = Outcome(content=reply.text, finish_reason="length" if reply.truncated else "stop",
                          turn_id=reply.turn_id, turn_token=reply.turn_token, prompt_tokens=reply.prompt_tokens,
                          streamed=not held_back, completion_tokens=reply.tokens, logprobs=reply.logprobs)
        self.router.record(reply.turn_id, chat.arm, chat.client)
        yield client_calls(outcome, chat.client_tools, chat.single_call) if held_back else outcome

    def _agent(self, chat: ChatRequest, cancel: threading.Event, backend) -> Agent:
        """A fresh agent on ``backend`` (the shared one, or a lane): client tools are returned, server
        tools run in its loop."""
        tools = chat.client_tools or (self.tools if chat.server_tools else None)
        sampling = replace(chat.sampling, call_threshold=self.call_threshold)
        agent = Agent(backend, self.model.sha256, tools=tools, sampling=sampling, store=self.store,
                      consent=self.consent, max_tool_rounds=0 if chat.client_tools else 4, cancel=cancel,
                      answer_grammar=chat.answer_grammar, logprobs=chat.logprobs)
        agent.conversation_id = chat.conversation_id or agent.conversation_id
        return agent

    # alternatives (on the model thread) and feedback
    def stored_turn(self, turn_id: int, token: str) -> Turn:
        """The turn with its prompt and sampling, if ``token`` is its token (else a 404:
        unknown and wrong alike)."""
        found = self.require_store().turn_by_token(turn_id, token)
        if found is None:
            raise ApiError(404, f"no turn {turn_id} with that turn_token; pass the x_turn_id and "
                                "x_turn_token of an answer", "not_found_error")
        return found

    def alternative(self, turn: Turn, seed: Optional[int], cancel: threading.Event) -> Iterator[str]:
        """A second answer to the turn's prompt, sampled as the runtime samples
        every second candidate."""
        with self.lease() as backend:
            self.router.apply(self.router.for_model_id(turn.model_id))
            agent = Agent(backend, self.model.sha256, sampling=stored_sampling(turn.sampling), cancel=cancel)
            text = agent.alternative(turn.messages, seed=seed)
        yield text

    def feedback(self, verdict: FeedbackBody) -> int:
        """Write the verdict as the runtime's agents do (a 404 unless the turn's token is
        presented), then let an A/B test decide again; returns the feedback row's id."""
        turn = self.stored_turn(verdict.turn_id, verdict.turn_token)
        feedback_id = record_feedback(self.require_store(), turn.id, verdict.kind, verdict.text, verdict.other,
                                      verdict.preferred, token=verdict.turn_token)
        self.router.evaluate()
        return feedback_id

    def require_store(self) -> PreferenceStore:
        """The preference store, or a 400 when the server records nothing."""
        if self.store is None:
            raise bad("this server records no turns; start it with --store "
                      "FILE to collect feedback")
        return self.store

    def close(self) -> None:
        """Stop the model threads (and the engine) and close the store."""
        self.worker.close()
        if self.engine is not None:
            self.engine.close()
            self.engine.decoder.close()
        if self.store is not None:
            self.store.close()


def client_calls(outcome: Outcome, tools: ToolRegistry, single: bool = False) -> Outcome:
    """The outcome with the model's calls of the client's tools as OpenAI ``tool_calls`` (if it made
    any; with ``single``, the first one only)."""
    parsed = tools.parse_calls(outcome.content or "")
    if not parsed.calls:
        return outcome
    calls = parsed.calls[:1] if single else parsed.calls
    outcome.tool_calls = [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                           "function": {"name": call.name, "arguments": json.dumps(call.arguments, ensure_ascii=False)}}
                          for call in calls]
    outcome.content = parsed.text or None
    outcome.finish_reason = "tool_calls"
    return outcome


def stored_sampling(recorded: dict) -> SamplingParams:
    """The sampling recorded with a turn (keys this version does not know are left out)."""
    known = {f.name for f in fields(SamplingParams)}
    return SamplingParams(**{key: value for key, value in recorded.items() if key in known})
