"""The one place a GGUF is opened in llama-cpp-python (``llama_cpp.Llama``), with its chat templates
kept away from llama-cpp-python's own Jinja.

``Llama.__init__`` reads the file's metadata into ``self.metadata`` and then compiles every
``tokenizer.chat_template`` and ``tokenizer.chat_template.NAME`` in it with plain Jinja (one
``Jinja2ChatFormatter`` each, whatever ``chat_format`` or ``chat_handler`` is passed), and plain
Jinja folds constant expressions while it compiles: a template starting
``{% if (7 ** (3 * 10 ** 7)) > 1 %}`` held a load for 44 s before our sandbox could refuse it.
Here ``metadata`` is a property of a subclass: the assignment keeps the templates aside
(:attr:`TemplateFreeLlama.chat_templates`) and leaves llama-cpp-python a metadata without them, so it
compiles none and falls back to its built-in chat format, which we never use (the runtime renders
with :mod:`slm_align.ondevice.templates.chat`, in :mod:`slm_align.ondevice.templates.sandbox`). The templates' text is
only read here; the runtime checks the one it uses in the sandbox before a chat starts or a model is
served, and named ones (``tool_use``) are never compiled at all.

Why a subclass and not a ``chat_handler``: llama-cpp-python builds a formatter for every template of
the file before it looks at ``chat_format`` or ``chat_handler`` (llama-cpp-python 0.3.x, ``llama.py``).
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Any

TEMPLATE_KEY = "tokenizer.chat_template"
"""The GGUF key of the default chat template; named ones are ``tokenizer.chat_template.NAME``."""


def is_template_key(key: str) -> bool:
    """``key`` holds a chat template (the default one or a named one)."""
    return key == TEMPLATE_KEY or key.startswith(TEMPLATE_KEY + ".")


@lru_cache(maxsize=1)
def template_free_llama() -> type:
    """:class:`TemplateFreeLlama`, made on first use (llama-cpp-python is an optional dependency)."""
    from llama_cpp import Llama

    class TemplateFreeLlama(Llama):
        """``llama_cpp.Llama`` whose ``metadata`` never shows a chat template: they are in
        :attr:`chat_templates` (GGUF key -> text), compiled by no one here."""

        @property
        def metadata(self) -> dict[str, str]:
            return self._slm_metadata

        @metadata.setter
        def metadata(self, value: dict[str, str]) -> None:
            self.chat_templates = {key: text for key, text in value.items() if is_template_key(key)}
            self._slm_metadata = {key: text for key, text in value.items() if not is_template_key(key)}

    return TemplateFreeLlama


def open_llama(model_path: Path, **options: Any):
    """``llama_cpp.Llama(model_path=..., **options)`` without llama-cpp-python compiling the file's
    chat templates (see the module's text); ``.chat_templates`` holds their text by GGUF key.
    Raises ImportError without llama-cpp-python and ValueError for a file llama.cpp cannot load."""
    return template_free_llama()(model_path=str(model_path), **options)
