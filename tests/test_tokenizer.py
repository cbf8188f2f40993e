"""Tokenizer, chat templates and the streaming detokenizer."""
import json
import random

import jinja2
import pytest
from tokenizers import Tokenizer as Backend, decoders, models

from nanokv.tokenizer import IncrementalDetokenizer, Tokenizer

TEXTS = [
    "Hello world",
    "héllo wörld 日本語 🙂",
    "def add(a, b):\n    return a + b  # sum\n\n\tx = [1, 2, 3]",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "Numbers 12345 and 3.14159, spaces  before  1 digit",
    "  leading and trailing spaces  ",
    "I'm sure they'll say it's fine, don't you think?",
    "",
]

CONVERSATION = [
    {"role": "user", "content": "Hi! Who are you?"},
    {"role": "assistant", "content": "I am SmolLM, an AI assistant."},
    {"role": "user", "content": "Tell me a joke about café 日本."},
]


@pytest.fixture(scope="module")
def tokenizer(bundled_dir):
    return Tokenizer.from_dir(bundled_dir)


@pytest.fixture(scope="module")
def hf_tokenizer(bundled_dir):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(bundled_dir)


def tiny_checkpoint(path, tokenizer_config=None, jinja_template=None):
    """A directory with a two-token tokenizer and, optionally, a config and a chat_template.jinja."""
    path.mkdir(exist_ok=True)
    Backend(models.WordLevel({"<unk>": 0, "<s>": 1}, unk_token="<unk>")).save(str(path / "tokenizer.json"))
    if tokenizer_config is not None:
        (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    if jinja_template is not None:
        (path / "chat_template.jinja").write_text(jinja_template)
    return path


# --- the bundled model's tokenizer ------------------------------------------------

def test_bundled_special_tokens(tokenizer):
    assert tokenizer.vocab_size == 49152
    assert (tokenizer.bos_token, tokenizer.bos_token_id) == ("<|im_start|>", 1)
    assert (tokenizer.eos_token, tokenizer.eos_token_id) == ("<|im_end|>", 2)


@pytest.mark.parametrize("text", TEXTS)
def test_ids_match_transformers(tokenizer, hf_tokenizer, text):
    assert tokenizer.encode(text) == hf_tokenizer.encode(text)
    assert tokenizer.encode(text, add_special_tokens=False) == hf_tokenizer.encode(text, add_special_tokens=False)


def test_no_bos_is_prepended_and_special_tokens_are_single_ids(tokenizer):
    assert tokenizer.encode("<|im_start|>user") == [1, tokenizer.encode("user")[0]]
    assert tokenizer.encode("Hello")[0] != tokenizer.bos_token_id


def test_digits_are_split_one_by_one(tokenizer):
    """llama.cpp's "smollm" pre-tokenizer isolates every digit before the GPT-2 split, so the
    two spaces in "x  12" stay one token (a plain GPT-2 split would cut them apart)."""
    pieces = [tokenizer.decode([i]) for i in tokenizer.encode("x  12")]
    assert pieces == ["x", "  ", "1", "2"]


@pytest.mark.parametrize("text", TEXTS)
def test_decode_inverts_encode(tokenizer, text):
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids, skip_special_tokens=False) == text


def test_decode_skips_special_tokens_by_default(tokenizer):
    ids = tokenizer.encode("<|im_start|>assistant\nParis<|im_end|>")
    assert tokenizer.decode(ids) == "assistant\nParis"


# --- chat templates ------------------------------------------------------------------

@pytest.mark.parametrize("messages", [
    CONVERSATION,
    [{"role": "system", "content": "You answer in French."}] + CONVERSATION,
    CONVERSATION[:1],
])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(tokenizer, hf_tokenizer, messages, add_generation_prompt):
    expected = hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt) == expected


def test_missing_tokenizer_json_names_the_directory(tmp_path):
    with pytest.raises(FileNotFoundError, match=f"no tokenizer.json in {tmp_path}.*requires tokenizer.json"):
        Tokenizer.from_dir(tmp_path)


def test_no_chat_template_is_a_clear_error(tmp_path):
    tokenizer = Tokenizer.from_dir(tiny_checkpoint(tmp_path))
    assert tokenizer.chat_template is None
    assert tokenizer.bos_token is None and tokenizer.bos_token_id is None
    with pytest.raises(ValueError, match=f"{tmp_path} has no chat template"):
        tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])


def test_chat_template_sources(tmp_path):
    listed = {"chat_template": [{"name": "tool_use", "template": "tools"},
                                {"name": "default", "template": "default"}]}
    assert Tokenizer.from_dir(tiny_checkpoint(tmp_path / "a", listed)).chat_template == "default"
    jinja_only = tiny_checkpoint(tmp_path / "b", {}, jinja_template="from jinja file")
    assert Tokenizer.from_dir(jinja_only).chat_template == "from jinja file"
    both = tiny_checkpoint(tmp_path / "c", {"chat_template": "from config"}, jinja_template="from jinja file")
    assert Tokenizer.from_dir(both).chat_template == "from config"
    no_default = tiny_checkpoint(tmp_path / "d", {"chat_template": [{"name": "tool_use", "template": "t"}]})
    with pytest.raises(ValueError, match="none named 'default'"):
        Tokenizer.from_dir(no_default)


def test_special_tokens_given_as_added_token_dicts(tmp_path):
    config = {"bos_token": {"content": "<s>", "lstrip": False, "special": True}, "eos_token": "<unk>"}
    tokenizer = Tokenizer.from_dir(tiny_checkpoint(tmp_path, config))
    assert (tokenizer.bos_token, tokenizer.bos_token_id) == ("<s>", 1)
    assert (tokenizer.eos_token, tokenizer.eos_token_id) == ("<unk>", 0)


def render(tmp_path, template, messages=(), **config):
    tokenizer = Tokenizer.from_dir(tiny_checkpoint(tmp_path, {"chat_template": template, **config}))
    return tokenizer.apply_chat_template(list(messages))


def test_template_environment_is_the_transformers_one(tmp_path):
    messages = [{"role": "user", "content": "é<b>"}, {"role": "user", "content": "skip"}]
    assert render(tmp_path, "{{ messages[0] | tojson }}", messages) == '{"role": "user", "content": "é<b>"}'
    assert render(tmp_path, "{{ messages[0] | tojson(indent=1) }}", messages).startswith('{\n "role"')
    assert render(tmp_path, "{% for m in messages %}{{ m.content }}{% break %}{% endfor %}", messages) == "é<b>"
    assert render(tmp_path, "{{ bos_token }}|{{ add_generation_prompt }}", bos_token="<s>") == "<s>|True"
    assert render(tmp_path, "{{ strftime_now('%Y') | length }}") == "4"
    # trim_blocks and lstrip_blocks: block tags leave no blank lines or indentation behind.
    assert render(tmp_path, "{% if true %}\n    {% if true %}\nx\n{% endif %}\n{% endif %}\n") == "x\n"
    with pytest.raises(jinja2.TemplateError, match="only user roles"):
        render(tmp_path, "{{ raise_exception('only user roles') }}")
    with pytest.raises(jinja2.exceptions.SecurityError):
        render(tmp_path, "{{ messages.append(1) }}")


# --- streaming detokenization ----------------------------------------------------

def stream(tokenizer, prompt_ids, output_ids, rng):
    """Feed `output_ids` in random chunks; returns what add() and flush() handed out."""
    detok = IncrementalDetokenizer(tokenizer, prompt_ids)
    pieces, start = [], 0
    while start < len(output_ids):
        size = rng.randint(1, 3)
        pieces.append(detok.add(output_ids[start:start + size]))
        start += size
    pieces.append(detok.flush())
    assert detok.num_chars == len("".join(pieces))
    return pieces


def test_streaming_never_splits_a_character(tokenizer):
    prompt = tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": "Say hi"}]))
    text = "héllo wörld 日本語 🙂 and 🇫🇷!"
    detok = IncrementalDetokenizer(tokenizer, prompt)
    pieces = [detok.add([i]) for i in tokenizer.encode(text)]
    assert "".join(pieces) == text
    assert "" in pieces   # some character took more than one token, and was held back
    assert not any("\ufffd" in p for p in pieces)
    assert detok.flush() == ""


def test_streaming_equals_decoding_on_random_tokens(tokenizer):
    """Random ids make invalid UTF-8, lone special tokens and split characters."""
    rng = random.Random(0)
    multilingual = tokenizer.encode("héllo wörld 日本語 🙂 <|im_end|> naïve café 🍕")
    prompt = tokenizer.encode("<|im_start|>user\nWrite something.<|im_end|>\n<|im_start|>assistant\n")
    for _ in range(200):
        ids = [rng.choice(multilingual) if rng.random() < 0.7 else rng.randrange(tokenizer.vocab_size)
               for _ in range(rng.randint(1, 40))]
        pieces = stream(tokenizer, prompt, ids, rng)
        assert "".join(pieces) == tokenizer.decode(ids)
        assert not any(p.endswith("\ufffd") for p in pieces[:-1])   # only flush may end mid-character


def test_streaming_decodes_a_short_window(tokenizer):
    calls = []

    class CountingTokenizer:
        def decode(self, ids, skip_special_tokens=True):
            calls.append(len(ids))
            return tokenizer.decode(ids, skip_special_tokens)

    ids = tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 30)
    detok = IncrementalDetokenizer(CountingTokenizer(), [])
    assert "".join(detok.add([i]) for i in ids) == tokenizer.decode(ids)
    assert max(calls) <= 3


def test_streaming_keeps_the_space_a_sentencepiece_continuation_starts_with(tmp_path):
    """Decoded alone, "▁there" loses its leading space; after the prompt it keeps it."""
    backend = Backend(models.WordLevel({"<unk>": 0, "▁Hi": 1, "▁there": 2}, unk_token="<unk>"))
    backend.decoder = decoders.Metaspace()
    backend.save(str(tmp_path / "tokenizer.json"))
    tokenizer = Tokenizer.from_dir(tmp_path)
    assert tokenizer.decode([2]) == "there"
    detok = IncrementalDetokenizer(tokenizer, [1])
    assert detok.add([2]) + detok.flush() == " there"
