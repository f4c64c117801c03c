import json

import pytest

from slm_align.data.preferences import read_preferences
from slm_align.errors import UserError


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def test_paired_and_unpaired_rows(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [
        {"prompt": "Q", "chosen": " good", "rejected": " bad", "source": "ignored extra column"},
        {"prompt": "P", "completion": " yes", "label": True},
        {"prompt": "P", "completion": " no", "label": False},
        {"prompt": "P", "completion": " maybe", "label": "false"},
        {"prompt": "R", "completion": " only good", "label": True},  # nothing to pair it with
    ])
    pairs = read_preferences(path)
    assert [(p.prompt, p.chosen, p.rejected) for p in pairs] == [("Q", " good", " bad"), ("P", " yes", " no"),
                                                                 ("P", " yes", " maybe")]
    assert [p.kind for p in pairs] == ["imported", "unpaired", "unpaired"]


def test_conversational_rows_render_through_the_chat_template(tmp_path, tokenizer):
    user = [{"role": "user", "content": "Tell me a story."}]
    path = write_jsonl(tmp_path / "chat.jsonl", [
        {"prompt": user, "chosen": [{"role": "assistant", "content": "Once upon a time."}],
         "rejected": [{"role": "assistant", "content": "No."}]},
        {"chosen": user + [{"role": "assistant", "content": "A cat sat."}],
         "rejected": user + [{"role": "assistant", "content": "Cat."}]},
    ])
    first, second = read_preferences(path, tokenizer)
    assert first.prompt == "<|im_start|>user\nTell me a story.<|im_end|>\n<|im_start|>assistant\n"
    assert first.chosen == "Once upon a time.<|im_end|>\n" and first.rejected == "No.<|im_end|>\n"
    assert second.prompt == first.prompt and second.chosen == "A cat sat.<|im_end|>\n"


@pytest.mark.parametrize("rows, expected", [
    ([{"prompt": "Q", "chosen": "a"}],
     r"needs prompt/chosen/rejected or prompt/completion/label \(found: prompt, chosen\)"),
    ([{"prompt": "Q", "chosen": 1, "rejected": "b"}], "column 'chosen' holds int"),
    ([{"prompt": "Q", "completion": "a", "label": "maybe"}], "'label' must be true or false"),
    ([{"prompt": "Q", "chosen": "same", "rejected": "same"}], "no usable pair"),
    ([], "are empty"),
])
def test_bad_preference_files_name_the_problem(tmp_path, rows, expected):
    path = write_jsonl(tmp_path / "bad.jsonl", rows)
    with pytest.raises(UserError, match=expected):
        read_preferences(path)
