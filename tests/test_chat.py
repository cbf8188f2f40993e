"""chat.py: piped input, commands, bad bytes, and Ctrl-C during a reply."""
import io
import subprocess
import sys
from pathlib import Path

import pytest

from chat import Chat
from nanokv import LLM, SamplingParams
from nanokv.tools.flags import interactive_threads

CHAT = Path(__file__).resolve().parent.parent / "chat.py"


def run_chat(stdin: bytes, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(CHAT), "--temperature", "0", "--max-tokens", "12",
                           "--max-model-len", "512", *args],
                          input=stdin, capture_output=True, timeout=300)


def test_piped_conversation_and_commands(bundled_dir):
    lines = [b"What is the capital of France?", b"/stats", b"/system You are a terse assistant.",
             b"\xff\xfe bad bytes", b"Name a color.", b"/reset", b"/nonsense", b"/quit", b"never read"]
    result = run_chat(b"\n".join(lines) + b"\n")
    out, err = result.stdout.decode(), result.stderr.decode()
    assert result.returncode == 0, err
    assert "Paris" in out
    assert "tokens/s" in out and "KV blocks used" in out
    assert f"; {interactive_threads()} CPU threads" in out   # all cores but one, unless told
    assert "[system prompt set; conversation cleared]" in out
    assert "byte 0xff at position 0 is not valid UTF-8" in err
    assert "[conversation cleared]" in out
    assert "unknown command '/nonsense'" in out


def test_bad_model_exits_with_a_clear_message(tmp_path):
    result = run_chat(b"", "--model", str(tmp_path / "missing"))
    assert result.returncode != 0
    assert "neither a local model directory nor a hub id" in result.stderr.decode()


@pytest.fixture(scope="module")
def llm(bundled_dir):
    return LLM(str(bundled_dir), dtype="float32", num_kv_blocks=128, max_model_len=512)


def test_ctrl_c_stops_the_reply_and_keeps_the_conversation(llm, monkeypatch):
    chat = Chat(llm, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True), out=io.StringIO())
    step, calls, shown = llm.step, [], []

    def interrupted_step():
        calls.append(1)
        if len(calls) == 4:
            raise KeyboardInterrupt
        outputs = step()
        shown.extend(token for out in outputs for token in out.new_token_ids)
        return outputs
    monkeypatch.setattr(llm, "step", interrupted_step)
    partial = chat.reply("Tell me a long story about a cat.")
    monkeypatch.setattr(llm, "step", step)
    assert "[stopped]" in chat.out.getvalue()
    assert not llm.has_unfinished() and llm.blocks.num_free == llm.blocks.num_blocks
    assert chat.last_stats["output_tokens"] == len(shown) > 0
    assert chat.messages == [{"role": "user", "content": "Tell me a long story about a cat."},
                             {"role": "assistant", "content": partial}]
    chat.reply("Now a short one.")   # the conversation goes on, with the cut reply in it
    assert len(chat.messages) == 4 and chat.last_stats["output_tokens"] == 40


def test_the_template_carries_earlier_turns(llm):
    chat = Chat(llm, SamplingParams(temperature=0, max_tokens=8), out=io.StringIO())
    first = chat.reply("Hello!")
    ids = chat._prompt_ids()
    text = llm.tokenizer.decode(ids, skip_special_tokens=False)
    assert "Hello!" in text and first.strip() in text and text.count("<|im_start|>user") == 1


def test_a_follow_up_turn_is_served_from_the_prefix_cache(llm, monkeypatch):
    prompts, add = [], llm.add_request
    monkeypatch.setattr(llm, "add_request", lambda ids, params: prompts.append(ids) or add(ids, params))
    chat = Chat(llm, SamplingParams(temperature=0, max_tokens=8), out=io.StringIO())
    chat.reply("What is the capital of France?")
    chat.reply("And of Italy?")
    first, second = prompts
    assert second[:len(first)] == first   # the template renders the earlier turn the same
    assert chat.last_stats["cached_prompt_tokens"] >= len(first) // 16 * 16 > 0
    assert "from the prefix cache" in chat.stats()
