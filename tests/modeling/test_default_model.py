"""The bundled model as shipped: the files its build recorded, and a tokenizer that keeps a tool call cheap."""

import hashlib
import json

from transformers import AutoTokenizer

from slm_align.modeling.models import DEFAULT_MODEL_DIR
from slm_align.ondevice.tools.calls import ToolCall
from slm_align.ondevice.tools.parse import call_text


def test_the_shipped_files_are_the_ones_the_build_script_recorded():
    build = json.loads((DEFAULT_MODEL_DIR / "build.json").read_text())
    shipped = {path.name: hashlib.sha256(path.read_bytes()).hexdigest() for path in DEFAULT_MODEL_DIR.iterdir()
               if path.name != "build.json"}
    assert shipped == build["sha256"]
    assert build["command"] == "python scripts/build_default_model.py"


def test_digits_are_single_tokens_and_a_call_costs_few():
    tokenizer = AutoTokenizer.from_pretrained(DEFAULT_MODEL_DIR)
    pieces = tokenizer.convert_ids_to_tokens(tokenizer("1786 and 47.5")["input_ids"])
    assert pieces[:4] == ["1", "7", "8", "6"] and "5" in pieces
    call = call_text([ToolCall("calculator", {"expression": "47 * 38"})])
    ids = tokenizer(call)["input_ids"]
    tags = tokenizer.convert_tokens_to_ids(["<tool_call>", "</tool_call>"])
    assert ids[0] == tags[0] and ids[-1] == tags[1]  # each tag one token
    assert len(ids) <= 26 and tokenizer.decode(ids) == call
