"""The artifact's chat template in the runtime: ``--chat-template`` in place of the model's own."""

from __future__ import annotations

from typing import Optional

from slm_align.chat_templates import chosen_chat_template


def use_chat_template(backend, option: Optional[str]) -> None:
    """Give ``backend`` the ``--chat-template`` ``option`` ("chatml" or a Jinja file) in
    place of its own, and record where it came from in ``backend.chat_template_origin``; None
    keeps the model's own."""
    if option is None:
        return
    chosen = chosen_chat_template(option)
    backend.chat_template = chosen.source
    backend.chat_template_origin = chosen.origin
