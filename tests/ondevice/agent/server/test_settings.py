"""What a served app is made with, as objects: ``create_app`` takes them or their fields by name
(the same app either way), refuses a keyword none of them has, and checks ``batch`` before the model
loads."""

from __future__ import annotations

import pytest

pytest.importorskip("starlette")

from slm_align.errors import UserError  # noqa: E402
from slm_align.ondevice.agent.server import app  # noqa: E402
from slm_align.ondevice.agent.server.settings import Answering, Opening, Routing  # noqa: E402


@pytest.fixture
def opened(monkeypatch) -> list:
    """How each app would load its model; nothing past the loading runs."""
    calls = []

    def load_model(artifact, device, threads, n_ctx, chat_template):
        calls.append((artifact, device, threads, n_ctx, chat_template))
        raise KeyboardInterrupt

    monkeypatch.setattr(app, "load_model", load_model)
    return calls


def test_the_objects_and_their_fields_by_name_open_the_model_alike(opened):
    by_object = {"opening": Opening(device="rpi5", threads=2, n_ctx=256, chat_template="chatml")}
    by_name = {"device": "rpi5", "threads": 2, "n_ctx": 256, "chat_template": "chatml"}
    mixed = {"opening": Opening(device="rpi5", threads=1), "threads": 2, "n_ctx": 256,
             "chat_template": "chatml", "max_queue": 3, "store_path": "prefs.db"}
    for options in (by_object, by_name, mixed):
        with pytest.raises(KeyboardInterrupt):
            app.create_app("model.gguf", **options)
    assert opened == [("model.gguf", "rpi5", 2, 256, "chatml")] * 3


def test_an_unknown_keyword_and_a_bad_batch_are_refused_before_the_model_loads(opened):
    with pytest.raises(TypeError, match="unexpected keyword argument 'max_queue_size'"):
        app.create_app("model.gguf", max_queue_size=3)
    for batch in (0, True, 1.5):
        with pytest.raises(UserError, match="--batch must be an integer >= 1"):
            app.create_app("model.gguf", answering=Answering(batch=batch))
    assert opened == []


def test_a_candidate_is_one_path_or_several():
    assert Routing(candidate="b.gguf").candidates() == ["b.gguf"]
    assert Routing(candidate=("b.gguf", "c.gguf")).candidates() == ["b.gguf", "c.gguf"]
    assert Routing().candidates() == []
