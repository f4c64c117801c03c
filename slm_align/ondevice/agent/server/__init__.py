"""``slm-align serve``: an OpenAI-compatible chat endpoint and a feedback
page over one exported model.

    app = create_app("model-Q8_0.gguf", store_path="prefs.db", consent=True)   # a Starlette app
    serve("model-Q8_0.gguf", port=8080, store_path="prefs.db")                  # ... run by uvicorn

Routes: ``POST /v1/chat/completions`` (OpenAI request and response shapes, streaming by
server-sent events, client-side function tools), ``GET /v1/models``, ``POST /v1/feedback``,
``POST /v1/alternative``, ``GET /v1/ab`` (the A/B test of a candidate adapter), ``GET /health`` and the
chat page at ``/``. Answers carry a
non-standard ``x_turn_id`` and ``x_turn_token``: the turn's id in the preference store, and the
unguessable token that feedback and alternatives on it must present, and ``x_conversation_id``: the
conversation's id, signed by the server, which the conversation's next request passes back to group its
turns (an id the server did not sign gets a new one; see :mod:`slm_align.ondevice.agent.server.adapters`).

One model, many requests at once: a GGUF model's requests (``batch`` of them, default 8) decode together,
each on a thread of its own and a sequence of one batched llama.cpp context (:mod:`slm_align.ondevice.agent.batching`);
ONNX models and adapter sets run one request at a time on one thread. At most ``max_queue`` requests wait
behind the running ones and later ones get 503. Bad requests get an
OpenAI-style ``{"error": {"message", "type"}}`` with a 4xx status and the server keeps serving.

Torch-free like the rest of ``slm_align.ondevice.agent``: Starlette here, uvicorn only inside :func:`serve`.

Modules: ``body`` (reading a body as JSON within the limits, the models' ground), ``chat_body``,
``feedback_body`` and ``completions`` (the request bodies as pydantic models), ``refusals`` (their
validation errors as 400s), ``chat_request`` (the validated chat request the service answers),
``worker`` (the model threads), ``service`` (what the routes share, answering on the model threads),
``responses`` (OpenAI's response shapes), ``routes`` (the routes and the API-key guard), ``guard``
(the Host/Origin check against DNS rebinding), ``adapters`` (which LoRA adapters answer a request, and the
A/B test of a candidate), ``app`` (``create_app`` and ``serve``), ``errors``.
"""

from slm_align.ondevice.agent.server.app import bind, check_exposure, create_app, is_loopback, serve
from slm_align.ondevice.agent.server.body import Limits
from slm_align.ondevice.agent.server.chat_request import ChatRequest, parse_chat
from slm_align.ondevice.agent.server.errors import ApiError
from slm_align.ondevice.agent.server.service import Outcome, Service
from slm_align.ondevice.agent.server.worker import ModelWorker

__all__ = ["ApiError", "ChatRequest", "Limits", "ModelWorker", "Outcome", "Service", "bind", "check_exposure",
           "create_app", "is_loopback", "parse_chat", "serve"]
