import json

import pytest

from lrmq.tokenizer import Tokenizer

QWEN_STYLE_TEMPLATE = """{% for message in messages %}
{% if loop.first and message['role'] != 'system' %}
<|im_start|>system
You are a helpful assistant.<|im_end|>
{% endif %}
{% if message['role'] not in ['system', 'user', 'assistant'] %}
{{ raise_exception('bad role ' + message['role']) }}
{% endif %}
<|im_start|>{{ message['role'] }}
{{ message['content'] }}<|im_end|>
{% endfor %}
{% if tools %}{{ tools | tojson }}
{% endif %}
{% if add_generation_prompt %}
<|im_start|>assistant
{% endif %}
{% if eos_token is defined %}{{ '' }}{% endif %}"""

SENTENCES = [
    "Compute 12+7*3-5. 7*3=21. 12+21=33. 33-5=28. \\boxed{28}",
    "The quick brown fox jumps over the lazy dog.",
    "Please reason step by step, and put your final answer within \\boxed{}.",
    "héllo wörld — unicode & <html> \"quotes\" don't",
]


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    from tokenizers import Tokenizer as HFTok, decoders, models, pre_tokenizers, trainers

    d = tmp_path_factory.mktemp("tok")
    t = HFTok(models.BPE())
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    t.train_from_iterator(SENTENCES * 4, trainer)
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(
        tokenizer_object=t,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>"],
    )
    fast.chat_template = QWEN_STYLE_TEMPLATE
    fast.save_pretrained(d)
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [t.token_to_id("<|im_end|>"), 0]}))
    return d


@pytest.fixture(scope="module")
def pair(tok_dir):
    from transformers import AutoTokenizer

    return Tokenizer.from_dir(tok_dir), AutoTokenizer.from_pretrained(tok_dir)


TEXTS = SENTENCES + ["<|im_start|>user\nhi 3+4<|im_end|>\n", "  leading  spaces\tand\ttabs\n\n", ""]


@pytest.mark.parametrize("special", [False, True])
def test_encode_decode_parity(pair, special):
    ours, hf = pair
    for text in TEXTS:
        ids = ours.encode(text, add_special_tokens=special)
        assert ids == hf.encode(text, add_special_tokens=special), text
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)
    assert ours.batch_encode(TEXTS) == [hf.encode(t, add_special_tokens=False) for t in TEXTS]
    assert ours.decode(ours.encode(SENTENCES[3])) == SENTENCES[3]


def test_chat_template_parity(pair):
    ours, hf = pair
    convs = [
        [{"role": "user", "content": "What is 2+2?"}],
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Compute 1+1."},
         {"role": "assistant", "content": "\\boxed{2}"}, {"role": "user", "content": "And 2*3?"}],
    ]
    for msgs in convs:
        for agp in (True, False):
            got = ours.apply_chat_template(msgs, add_generation_prompt=agp)
            want = hf.apply_chat_template(msgs, add_generation_prompt=agp, tokenize=False)
            assert got == want
        assert got.startswith("<|im_start|>system\n")
    assert ours.apply_chat_template(convs[0]).endswith("<|im_start|>assistant\n")
    assert not ours.apply_chat_template(convs[0], add_generation_prompt=False).endswith("assistant\n")
    tools = [{"name": "f", "description": "a <b> & 'c' é"}]
    assert ours.apply_chat_template(convs[0], tools=tools) == hf.apply_chat_template(
        convs[0], tools=tools, add_generation_prompt=True, tokenize=False
    )
    with pytest.raises(Exception, match="bad role tool"):
        ours.apply_chat_template([{"role": "tool", "content": "x"}])


def test_special_ids(pair, tok_dir):
    ours, hf = pair
    im_end = hf.convert_tokens_to_ids("<|im_end|>")
    assert ours.eos_ids == (im_end, 0)  # generation_config first, tokenizer eos deduped
    assert ours.pad_id == hf.pad_token_id == 0
    assert ours.bos_id is None
    assert ours.vocab_size == len(hf)
    assert ours.token_to_id("<|im_start|>") == hf.convert_tokens_to_ids("<|im_start|>")


def test_config_variants(tok_dir, tmp_path):
    # tokenizer_config with dict-valued tokens, a template list, no generation_config and no pad token.
    import shutil

    d = tmp_path / "v"
    d.mkdir()
    shutil.copy(tok_dir / "tokenizer.json", d / "tokenizer.json")
    (d / "tokenizer_config.json").write_text(json.dumps({
        "eos_token": {"content": "<|endoftext|>", "special": True},
        "bos_token": "<|im_start|>",
        "chat_template": [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "{{ bos_token }}D"}],
    }))
    t = Tokenizer.from_dir(d)
    assert t.eos_ids == (0,) and t.pad_id == 0 and t.bos_id == t.token_to_id("<|im_start|>")
    assert t.apply_chat_template([{"role": "user", "content": "x"}]) == "<|im_start|>D"
    # generation_config supplies ids when the tokenizer config has none
    (d / "tokenizer_config.json").write_text("{}")
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": 2, "pad_token_id": 1, "bos_token_id": 1}))
    t = Tokenizer.from_dir(d)
    assert (t.eos_ids, t.pad_id, t.bos_id) == ((2,), 1, 1)
    with pytest.raises(ValueError, match="no chat template"):
        t.apply_chat_template([{"role": "user", "content": "x"}])


def test_errors(tmp_path, tok_dir):
    with pytest.raises(FileNotFoundError, match="no tokenizer.json") as e:
        Tokenizer.from_dir(tmp_path)
    assert str(tmp_path) in str(e.value)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        Tokenizer.from_dir(tmp_path / "missing")
    import shutil

    d = tmp_path / "bad"
    d.mkdir()
    shutil.copy(tok_dir / "tokenizer.json", d / "tokenizer.json")
    (d / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    with pytest.raises(ValueError, match=r"tokenizer_config.json: eos_token '</s>' is not in the vocabulary"):
        Tokenizer.from_dir(d)
