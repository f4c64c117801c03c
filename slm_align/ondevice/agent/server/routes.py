"""The routes: chat completions, feedback, alternatives, models, the A/B test, health and the
page; the API-key guard."""

from __future__ import annotations

import hmac
from functools import partial

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from slm_align.ondevice.agent.server.adapters import DEFAULT
from slm_align.ondevice.agent.server.body import read_json
from slm_align.ondevice.agent.server.chat_request import parse_chat
from slm_align.ondevice.agent.server.errors import ApiError, error_response
from slm_align.ondevice.agent.server.feedback_body import AlternativeBody, FeedbackBody
from slm_align.ondevice.agent.server.refusals import validate
from slm_align.ondevice.agent.server.responses import Meta, completion_body, last_item, sse_stream
from slm_align.ondevice.agent.server.service import Outcome, Service

PAGE_CSP = ("default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; "
            "connect-src 'self'; img-src data:; base-uri 'none'; form-action 'none'; "
            "frame-ancestors 'none'")
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
"""Headers of a streamed answer: nothing between the model and the client
may hold its events back."""


def _service(request: Request) -> Service:
    return request.app.state.service


async def _body(request: Request) -> dict:
    return await read_json(request, _service(request).limits.max_body_bytes)


async def chat_completions(request: Request):
    """``POST /v1/chat/completions``: one answer, whole or streamed by server-sent events.

    The request is checked on a worker thread: its tools' schemas (checked by jsonschema, turned
    into a grammar) may take a moment, which /health and every other client must not wait out.
    """
    service = _service(request)
    chat = await run_in_threadpool(parse_chat, await _body(request), service.limits, service.model.backend.kind)
    chosen = service.choose(chat, request.client.host if request.client else "")
    events = service.worker.run(partial(service.answer, chat, chosen), request.receive)
    first = await anext(events, None)  # a full queue or a prompt too long is refused here, before any byte is sent
    if first is None:
        return client_left()
    meta = Meta.new(chosen.name, chat.conversation_id)
    if chat.stream:
        return StreamingResponse(sse_stream(first, events, meta, chat), media_type="text/event-stream",
                                 headers=SSE_HEADERS)
    outcome = first if isinstance(first, Outcome) else await last_item(events)
    if not isinstance(outcome, Outcome):
        return client_left()
    return JSONResponse(completion_body(meta, outcome))


def client_left() -> Response:
    """What a request whose client disconnected gets (nobody reads it): nginx's 499,
    "client closed request"."""
    return Response(status_code=499)


async def feedback(request: Request):
    """``POST /v1/feedback``: a verdict on a recorded turn."""
    service = _service(request)
    verdict = validate(FeedbackBody, await _body(request), service.limits)
    feedback_id = await run_in_threadpool(service.feedback, verdict)
    return JSONResponse({"object": "feedback", "id": feedback_id, "turn_id": verdict.turn_id, "kind": verdict.kind})


async def alternative(request: Request):
    """``POST /v1/alternative``: a second answer to a recorded turn's prompt, for a
    "which is better" choice."""
    service = _service(request)
    wanted = validate(AlternativeBody, await _body(request), service.limits)
    turn = await run_in_threadpool(service.stored_turn, wanted.turn_id, wanted.turn_token)
    text = await last_item(service.worker.run(partial(service.alternative, turn, wanted.seed), request.receive))
    if text is None:
        return client_left()
    return JSONResponse({"object": "alternative", "turn_id": wanted.turn_id, "content": text})


async def models(request: Request):
    """``GET /v1/models``: the model served; with adapters, every name a request may pass as ``model``
    (``default`` first: whatever the conversation is routed to)."""
    service = _service(request)
    model, router = service.model, service.router
    sets = list(router.sets.values())
    entries = [{"id": found.name, "x_model_id": found.model_id, "x_adapters": [path.name for path in found.paths]}
               for found in sets]
    if len(sets) > 1:
        entries.insert(0, {"id": DEFAULT, "x_model_id": router.current.model_id, "x_routes_to": router.current.name})
    common = {"object": "model", "created": 0, "owned_by": "slm-align", "x_sha256": model.sha256,
              "x_chat_template": model.backend.chat_template_origin}
    return JSONResponse({"object": "list", "data": [{**entry, **common} for entry in entries]})


async def ab_test(request: Request):
    """``GET /v1/ab``: the A/B test of the candidate adapter: its state, arms and latest evidence."""
    trial = _service(request).router.trial
    if trial is None:
        raise ApiError(404, "this server runs no A/B test; start it with --candidate FILE (and --store FILE)",
                       "not_found_error")
    return JSONResponse(trial.as_dict())


async def health(request: Request):
    """``GET /health``: the model, the backend, and how busy the model thread is."""
    service = _service(request)
    return JSONResponse({"status": "ok", "model": service.model.name, "adapter": service.router.current.name,
                         "backend": service.model.backend.kind,
                         "store": service.store is not None, "tools": service.tools is not None,
                         "active_requests": service.worker.active, "abandoned_requests": service.worker.abandoned})


async def page(request: Request):
    """``GET /``: the chat page, one self-contained file under a strict content security policy."""
    return HTMLResponse(request.app.state.page, headers={"Content-Security-Policy": PAGE_CSP,
                                                          "X-Content-Type-Options": "nosniff"})


ROUTES = [Route("/", page), Route("/health", health), Route("/v1/models", models),
          Route("/v1/chat/completions", chat_completions, methods=["POST"]),
          Route("/v1/feedback", feedback, methods=["POST"]),
          Route("/v1/alternative", alternative, methods=["POST"]), Route("/v1/ab", ab_test)]


class BearerAuth:
    """ASGI middleware: every /v1 route needs ``Authorization: Bearer KEY`` (the
    page and /health do not)."""

    def __init__(self, app, key: str):
        self.app = app
        self._expected = f"Bearer {key}".encode()

    async def __call__(self, scope, receive, send):
        """Refuse an unauthorized /v1 request with 401; pass everything else on."""
        if scope["type"] == "http" and scope["path"].startswith("/v1") and not self._authorized(scope):
            response = error_response(401, "missing or wrong API key; send the header "
                                      "'Authorization: Bearer KEY'",
                                      "authentication_error", {"WWW-Authenticate": "Bearer"})
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)

    def _authorized(self, scope) -> bool:
        sent = dict(scope["headers"]).get(b"authorization", b"")
        return hmac.compare_digest(sent, self._expected)
