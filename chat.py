"""Chat with a model in the terminal: python chat.py [--model DIR_OR_HUB_ID].

Replies stream as they are generated. Commands: /reset, /system TEXT, /stats,
/quit. Ctrl-C during a reply stops that reply and keeps the conversation;
Ctrl-C or Ctrl-D at the prompt leaves. With stdin a pipe, every input line
gets one reply, so the script can be driven by other programs.
"""
from __future__ import annotations

import argparse
import sys
import time

import torch

from nanokv import LLM, SamplingParams
from nanokv.tools.flags import add_engine_flags, interactive_options

HELP = "commands: /reset  /system TEXT  /stats  /quit"


class Chat:
    """A conversation: the messages so far, and how to get the next reply."""

    def __init__(self, llm: LLM, params: SamplingParams, out=sys.stdout):
        self.llm, self.params, self.out = llm, params, out
        self.system: str | None = None
        self.messages: list[dict] = []
        self.last_stats: dict | None = None

    def reset(self) -> None:
        self.messages = []

    def _prompt_ids(self) -> list[int]:
        """The templated conversation; the oldest turns go first if it is too long. The template
        renders earlier turns the same every time, so a follow-up's prompt starts with the
        previous one and the engine's prefix cache serves it (only its blocks' worth)."""
        budget = self.llm.config.max_model_len - self.params.max_tokens
        while True:
            system = [{"role": "system", "content": self.system}] if self.system else []
            text = self.llm.tokenizer.apply_chat_template(system + self.messages)
            ids = self.llm.tokenizer.encode(text, add_special_tokens=False)
            if len(ids) <= budget or len(self.messages) <= 1:
                return ids
            self.messages = self.messages[2:]   # drop the oldest user/assistant pair
            print("[the conversation is too long: dropped its oldest turn]", file=sys.stderr)

    def reply(self, user_text: str) -> str:
        """Stream the assistant's answer to user_text; Ctrl-C cuts it short."""
        self.messages.append({"role": "user", "content": user_text})
        ids = self._prompt_ids()
        start, first, peak_blocks, text, n, cached = time.perf_counter(), None, 0, "", 0, 0
        request = self.llm.add_request(ids, self.params)
        try:
            while self.llm.has_unfinished():
                for out in self.llm.step():
                    if out.request_id != request:
                        continue
                    first = first or time.perf_counter()
                    self.out.write(out.new_text)
                    if out.finish_reason == "error":
                        self.out.write(f" [error: {out.error}]")
                    self.out.flush()
                    text, n, cached = out.text, len(out.token_ids), out.num_cached_tokens
                stats = self.llm.stats()
                peak_blocks = max(peak_blocks, stats.total_blocks - stats.free_blocks)
        except KeyboardInterrupt:
            self.llm.abort(request)
            self.out.write(" [stopped]")
        self.out.write("\n")
        elapsed = time.perf_counter() - start
        self.messages.append({"role": "assistant", "content": text})
        self.last_stats = dict(prompt_tokens=len(ids), cached_prompt_tokens=cached, output_tokens=n, seconds=elapsed,
                               first_token_seconds=(first or time.perf_counter()) - start,
                               kv_blocks=peak_blocks)
        return text

    def stats(self) -> str:
        if self.last_stats is None:
            return "no reply yet"
        s, engine = self.last_stats, self.llm.stats()
        rate = s["output_tokens"] / s["seconds"] if s["seconds"] > 0 else 0.0
        return (f"last reply: {s['output_tokens']} tokens in {s['seconds']:.2f}s ({rate:.1f} tokens/s), "
                f"first token after {s['first_token_seconds']:.2f}s, prompt {s['prompt_tokens']} tokens "
                f"({s['cached_prompt_tokens']} from the prefix cache); "
                f"KV blocks used {s['kv_blocks']} of {engine.total_blocks} ({engine.block_size} tokens each); "
                f"{torch.get_num_threads()} CPU threads")

    def handle(self, line: str) -> bool:
        """Act on one input line; False means quit."""
        command, _, arg = line.strip().partition(" ")
        if command == "/quit":
            return False
        if command == "/reset":
            self.reset()
            print("[conversation cleared]", file=self.out)
        elif command == "/system":
            self.system = arg.strip() or None
            self.reset()
            print(f"[system prompt {'set' if self.system else 'cleared'}; conversation cleared]", file=self.out)
        elif command == "/stats":
            print(self.stats(), file=self.out)
        elif command.startswith("/"):
            print(f"unknown command {command!r}; {HELP}", file=self.out)
        elif line.strip():
            self.reply(line.strip())
        return True


def read_line(interactive: bool) -> str | None:
    """One line of stdin as text; None at end of input. Bytes that are not
    UTF-8 get a clear message and the line is skipped."""
    while True:
        if interactive:
            sys.stdout.write("> ")
            sys.stdout.flush()
        raw = sys.stdin.buffer.readline()
        if not raw:
            return None
        try:
            return raw.decode("utf-8").rstrip("\r\n")
        except UnicodeDecodeError as e:
            print(f"[input ignored: byte {raw[e.start]:#04x} at position {e.start} is not valid UTF-8]",
                  file=sys.stderr)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="HF model directory or hub id (default: bundled SmolLM2-135M)")
    parser.add_argument("--max-tokens", type=int, default=512)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--top-p", type=float, default=0.9)
    add_engine_flags(parser)
    args = parser.parse_args(argv)
    try:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p)
        llm = LLM(args.model, **interactive_options(args))
    except (ValueError, OSError, TypeError, torch.OutOfMemoryError) as e:
        sys.exit(f"chat.py: {e}")
    interactive = sys.stdin.isatty()
    if interactive:
        print(f"nanokv chat ({HELP}; Ctrl-C stops a reply)")
    chat = Chat(llm, params)
    try:
        while (line := read_line(interactive)) is not None and chat.handle(line):
            pass
    except KeyboardInterrupt:
        print()


if __name__ == "__main__":
    main()
