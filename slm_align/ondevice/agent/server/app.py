"""Building the app and serving it: ``create_app`` for any ASGI server, ``serve``
to listen with uvicorn."""

from __future__ import annotations

import os
import socket
from contextlib import asynccontextmanager
from importlib import resources
from pathlib import Path
from typing import Any, Callable, Optional, Sequence, Union

from starlette.applications import Starlette

from slm_align.errors import UserError
from slm_align.ondevice.agent.loading import Model, load_model
from slm_align.ondevice.agent.server.adapters import AdapterRouter
from slm_align.ondevice.agent.server.body import Limits
from slm_align.ondevice.agent.server.completions import COMPLETION_ROUTES
from slm_align.ondevice.agent.server.errors import HANDLERS
from slm_align.ondevice.agent.server.guard import HostGuard, is_loopback
from slm_align.ondevice.agent.server.routes import ROUTES, BearerAuth
from slm_align.ondevice.agent.server.service import Service
from slm_align.ondevice.agent.server.settings import Access, Answering, Opening, Routing
from slm_align.ondevice.agent.settings import check_call_threshold, refuse_unknown, take_options
from slm_align.ondevice.agent.store import PreferenceStore
from slm_align.ondevice.templates.artifact import check_chat_template
from slm_align.ondevice.tools.builtin import default_tools

WILDCARD_ADDRESSES = ("0.0.0.0", "::", "[::]", "")


def read_page() -> str:
    """The chat page's HTML, shipped with the package."""
    page = resources.files("slm_align.ondevice.agent").joinpath("static/index.html")
    return page.read_text(encoding="utf-8")


def create_app(artifact: Union[str, Path], opening: Opening = Opening(), access: Access = Access(),
               answering: Answering = Answering(), routing: Routing = Routing(),
               limits: Optional[Limits] = None, **options: Any) -> Starlette:
    """The server as an ASGI app (run it with uvicorn or :func:`serve`) over ``artifact``, a .gguf
    file or an ONNX export directory.

    ``opening``: how the model loads; ``access``: who may call; ``answering``: where turns are
    recorded, which tools run, how many requests decode together; ``routing``: which adapters
    answer (:mod:`slm_align.ondevice.agent.server.settings`); ``limits``: what one request may ask
    (:class:`Limits`). ``options``: any field of these by name (``store_path="prefs.db",
    consent=True, max_queue=64``), replacing the object's.
    """
    opening, access, answering, routing = (take_options(group, options) for group in
                                           (opening, access, answering, routing))
    limits = take_options(limits or Limits(), options)
    refuse_unknown("create_app", options)
    batch = answering.batch
    if not isinstance(batch, int) or isinstance(batch, bool) or batch < 1:
        raise UserError(f"--batch must be an integer >= 1 (requests decoded together), got {batch}")
    check_call_threshold(answering.call_threshold)
    model = load_model(artifact, opening.device, opening.threads, opening.n_ctx,
                       opening.chat_template)
    if getattr(model.backend, "adapters", ()):  # the router owns the adapters: a chain given as one
        raise UserError(f"{artifact} names a base with adapters; serve takes the base GGUF and "
                        "each adapter set as --adapter NAME=FILE (the candidate as --candidate)")
    check_chat_template(model.backend)  # at startup, not by every request holding the model thread
    service = _service(model, answering, routing, limits)

    @asynccontextmanager
    async def lifespan(app):
        yield
        service.close()

    app = Starlette(routes=ROUTES + COMPLETION_ROUTES, exception_handlers=HANDLERS,
                    lifespan=lifespan)
    if access.api_key:
        app.add_middleware(BearerAuth, key=access.api_key)
    else:
        app.add_middleware(HostGuard, allowed_hosts=access.allowed_hosts)
    app.state.service = service
    app.state.page = read_page()
    return app


def _service(model: Model, answering: Answering, routing: Routing, limits: Limits) -> Service:
    """What the routes share: the model, its store, tools and adapter router."""
    path = answering.store_path
    store = PreferenceStore(Path(path)) if path is not None else None
    try:
        router = AdapterRouter(model, routing.adapters, routing.candidates(),
                               routing.candidate_share, store, routing.ab_test)
    except BaseException:
        if store is not None:
            store.close()
        raise
    tools = default_tools(answering.notes) if answering.tools else None
    return Service(model, store, answering.consent, tools, limits, router, answering.batch, answering.call_threshold)


def check_exposure(host: str, api_key: Optional[str], insecure: bool) -> None:
    """Listening beyond loopback needs an API key, or an explicit ``insecure``."""
    if not is_loopback(host) and not api_key and not insecure:
        raise UserError(f"refusing to listen on {host} without an API key: anyone who can reach "
                        "it could use the model and write to the preference store; pass --api-key "
                        "KEY (or set SLM_ALIGN_API_KEY), or --insecure to accept that")


def bind(host: str, port: int) -> socket.socket:
    """A listening socket, or a one-line UserError (port in use, unknown address)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        return socket.create_server((host.strip("[]"), port), family=family, reuse_port=False)
    except OSError as exc:
        reason = os.strerror(exc.errno) if exc.errno else str(exc)
        raise UserError(f"cannot listen on {host}:{port} ({reason}); pass "
                        "another --port or --host") from None


def serve(artifact: Union[str, Path], host: str = "127.0.0.1", port: int = 8080,
          api_key: Optional[str] = None, insecure: bool = False, log_level: str = "info",
          announce: Optional[Callable[[dict], None]] = None, **options: Any) -> None:
    """Check the address, load the model, listen, and answer until interrupted (Ctrl-C); with the
    connection limits of :func:`slm_align.ondevice.agent.server.connections.server_config`.

    ``options`` go to :func:`create_app` (the key is ``api_key``); ``announce`` receives
    ``{url, model, store, api_key}`` once listening.
    """
    import uvicorn

    from slm_align.ondevice.agent.server.connections import server_config

    check_exposure(host, api_key, insecure)
    sock = bind(host, port)  # before loading the model: a taken port fails fast
    try:
        access = take_options(options.pop("access", Access()), options)
        names = listening_names(host, access.allowed_hosts)
        answering = take_options(options.pop("answering", Answering()), options)
        app = create_app(artifact, access=Access(api_key, names), answering=answering, **options)
    except BaseException:
        sock.close()
        raise
    if announce is not None:
        announce(_listening(app, host, sock, api_key, answering.store_path))
    uvicorn.Server(server_config(app, log_level)).run(sockets=[sock])


def listening_names(host: str, allowed_hosts: Sequence[str]) -> list[str]:
    """The host names a request may address: those allowed, and the address listened on
    unless it is a wildcard."""
    names = list(allowed_hosts)
    if host not in WILDCARD_ADDRESSES:
        names.append(host)
    return names


def _listening(app: Starlette, host: str, sock: socket.socket, api_key: Optional[str],
               store_path: Any) -> dict:
    """What :func:`serve` announces once listening."""
    shown = f"[{host}]" if ":" in host else host
    return {"url": f"http://{shown}:{sock.getsockname()[1]}/",
            "model": app.state.service.model.name,
            "store": str(store_path) if store_path else None, "api_key": bool(api_key)}
