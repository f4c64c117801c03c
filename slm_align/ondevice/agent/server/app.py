"""Building the app and serving it: ``create_app`` for any ASGI server, ``serve``
to listen with uvicorn."""

from __future__ import annotations

import os
import socket
from contextlib import asynccontextmanager
from importlib import resources
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Sequence, Union

from starlette.applications import Starlette

from slm_align.errors import UserError
from slm_align.ondevice.agent.ab_sequential import SequentialTest
from slm_align.ondevice.agent.loading import load_model
from slm_align.ondevice.agent.server.adapters import AdapterRouter
from slm_align.ondevice.agent.server.body import Limits
from slm_align.ondevice.agent.server.completions import COMPLETION_ROUTES
from slm_align.ondevice.agent.server.errors import HANDLERS
from slm_align.ondevice.agent.server.guard import HostGuard, is_loopback
from slm_align.ondevice.agent.server.routes import ROUTES, BearerAuth
from slm_align.ondevice.agent.server.service import DEFAULT_BATCH, Service
from slm_align.ondevice.agent.store import PreferenceStore
from slm_align.ondevice.templates.artifact import check_chat_template

WILDCARD_ADDRESSES = ("0.0.0.0", "::", "[::]", "")


def read_page() -> str:
    """The chat page's HTML, shipped with the package."""
    return resources.files("slm_align.ondevice.agent").joinpath("static/index.html").read_text(encoding="utf-8")


def create_app(artifact: Union[str, Path], store_path: Union[str, Path, None] = None, api_key: Optional[str] = None,
               consent: bool = False, tools: bool = False, notes: Union[str, Path, None] = None,
               device: Optional[str] = None, threads: Optional[int] = None, n_ctx: Optional[int] = None,
               allowed_hosts: Sequence[str] = (), chat_template: Optional[str] = None,
               adapters: Optional[Mapping[str, Sequence[Union[str, Path]]]] = None,
               candidate: Union[str, Path, Sequence[Union[str, Path]], None] = None, candidate_share: float = 0.5,
               ab_test: SequentialTest = SequentialTest(), batch: int = DEFAULT_BATCH, **limits: int) -> Starlette:
    """The server as an ASGI app (run it with uvicorn or :func:`serve`).

    Args:
        artifact: A .gguf file or an ONNX export directory. store_path: Preference database to
        record turns and feedback in (None: record nothing). api_key: When set, every /v1 route
        needs ``Authorization: Bearer <api_key>``. consent: Mark recorded turns as consented for
        training. tools: Run the built-in tools (calculator, clock, and notes in ``notes``) on the
        server. notes: Folder the notes tools may use (with ``tools``). device, threads, n_ctx: How
        to load the model, as for ``Agent.load``. allowed_hosts: Host names accepted besides
        loopback ones when no ``api_key`` is set (``*``: any); see
            :mod:`slm_align.ondevice.agent.server.guard`.
        chat_template: "chatml" or a Jinja file in place of the model's own (base
        models have none; without one,
            chat requests are refused and /v1/completions still continues plain text).
        adapters: Named LoRA adapter sets for a GGUF base, ``{name: [adapter GGUFs in order]}``, picked
        by a request's ``model``; the first is the current one (see
            :mod:`slm_align.ondevice.agent.server.adapters`).
        candidate: An adapter GGUF (or a list, applied in order) to A/B-test against the current set on the
        users' thumbs (needs ``store_path``); candidate_share: the share of conversations it gets;
        ab_test: the sequential test's settings.
        batch: Requests of a GGUF model decoded together (one llama.cpp context, a sequence each; 1: one
        at a time on one model thread, as ONNX models and adapter sets always are).
        limits: Any :class:`Limits` field (max_body_bytes, max_queue, max_messages, ...).
    """
    from slm_align.ondevice.tools.builtin import default_tools

    settings = Limits(**limits)
    if not isinstance(batch, int) or isinstance(batch, bool) or batch < 1:
        raise UserError(f"--batch must be an integer >= 1 (requests decoded together), got {batch}")
    model = load_model(artifact, device, threads, n_ctx, chat_template)
    if getattr(model.backend, "adapters", ()):  # the router owns the adapters: a chain given as one artifact
        raise UserError(f"{artifact} names a base with adapters; serve takes the base GGUF and each adapter "
                        "set as --adapter NAME=FILE (the candidate as --candidate)")
    check_chat_template(model.backend)  # refused at startup, not by every request holding the model thread
    store = PreferenceStore(Path(store_path)) if store_path is not None else None
    candidates = [candidate] if isinstance(candidate, (str, Path)) else list(candidate or ())
    try:
        router = AdapterRouter(model, adapters, candidates, candidate_share, store, ab_test)
    except BaseException:
        if store is not None:
            store.close()
        raise
    service = Service(model, store, consent, default_tools(notes) if tools else None, settings, router, batch)

    @asynccontextmanager
    async def lifespan(app):
        yield
        service.close()

    app = Starlette(routes=ROUTES + COMPLETION_ROUTES, exception_handlers=HANDLERS, lifespan=lifespan)
    if api_key:
        app.add_middleware(BearerAuth, key=api_key)
    else:
        app.add_middleware(HostGuard, allowed_hosts=allowed_hosts)
    app.state.service = service
    app.state.page = read_page()
    return app


def check_exposure(host: str, api_key: Optional[str], insecure: bool) -> None:
    """Listening beyond loopback needs an API key, or an explicit ``insecure``."""
    if not is_loopback(host) and not api_key and not insecure:
        raise UserError(f"refusing to listen on {host} without an API key: anyone who can reach it could use the "
                        "model and write to the preference store; pass --api-key KEY (or set SLM_ALIGN_API_KEY), "
                        "or --insecure to accept that")


def bind(host: str, port: int) -> socket.socket:
    """A listening socket, or a one-line UserError (port in use, unknown address)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        return socket.create_server((host.strip("[]"), port), family=family, reuse_port=False)
    except OSError as exc:
        reason = os.strerror(exc.errno) if exc.errno else str(exc)
        raise UserError(f"cannot listen on {host}:{port} ({reason}); pass "
                        "another --port or --host") from None


def serve(artifact: Union[str, Path], host: str = "127.0.0.1", port: int = 8080, api_key: Optional[str] = None,
          insecure: bool = False, log_level: str = "info", announce: Optional[Callable[[dict], None]] = None,
          **options: Any) -> None:
    """Check the address, load the model, listen, and answer until interrupted (Ctrl-C); with the
    connection limits of :func:`slm_align.ondevice.agent.server.connections.server_config`.

    ``options`` go to :func:`create_app`; ``announce`` receives ``{url, model, store,
    api_key}`` once listening.
    """
    import uvicorn

    from slm_align.ondevice.agent.server.connections import server_config

    check_exposure(host, api_key, insecure)
    sock = bind(host, port)  # before loading the model: a taken port fails fast
    try:
        names = listening_names(host, options.pop("allowed_hosts", ()))
        app = create_app(artifact, api_key=api_key, allowed_hosts=names, **options)
    except BaseException:
        sock.close()
        raise
    if announce is not None:
        announce(_listening(app, host, sock, api_key, options.get("store_path")))
    uvicorn.Server(server_config(app, log_level)).run(sockets=[sock])


def listening_names(host: str, allowed_hosts: Sequence[str]) -> list[str]:
    """The host names a request may address: those allowed, and the address listened on
    unless it is a wildcard."""
    names = list(allowed_hosts)
    if host not in WILDCARD_ADDRESSES:
        names.append(host)
    return names


def _listening(app: Starlette, host: str, sock: socket.socket, api_key: Optional[str], store_path: Any) -> dict:
    """What :func:`serve` announces once listening."""
    shown = f"[{host}]" if ":" in host else host
    return {"url": f"http://{shown}:{sock.getsockname()[1]}/", "model": app.state.service.model.name,
            "store": str(store_path) if store_path else None, "api_key": bool(api_key)}
