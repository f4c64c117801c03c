"""The artifact's chat template in the runtime: ``--chat-template`` in place of the model's own, and
the trial render that refuses a template that loops or fails before a chat starts or a model is
served."""

from __future__ import annotations

from typing import Optional

from slm_align.ondevice.templates.chat import check_template, chosen_chat_template


def use_chat_template(backend, option: Optional[str]) -> None:
    """Give ``backend`` the ``--chat-template`` ``option`` ("chatml" or a Jinja file) in
    place of its own, and record where it came from in ``backend.chat_template_origin``; None
    keeps the model's own."""
    if option is None:
        return
    chosen = chosen_chat_template(option)
    backend.chat_template = chosen.source
    backend.chat_template_origin = chosen.origin


def check_chat_template(backend) -> None:
    """Render ``backend``'s chat template once, bounded
    (:func:`~slm_align.ondevice.templates.chat.check_template`): one that loops or fails is a
    one-line ChatTemplateError naming it, before any request waits on it. A backend without a
    template passes (plain completions need none)."""
    check_template(backend.chat_template, getattr(backend, "chat_template_origin", None))
