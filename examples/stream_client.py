"""Stream a completion from a minidsa server and print the text as it arrives.

    minidsa serve --port 8000 &
    python examples/stream_client.py --url http://127.0.0.1:8000 --prompt "The capital of France is"
    python examples/stream_client.py --chat --prompt "Write a haiku about sparse attention"
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys

import aiohttp


async def stream(url: str, prompt: str, max_tokens: int, temperature: float, chat: bool, api_key: str | None,
                 ignore_eos: bool) -> int:
    body: dict = {"max_tokens": max_tokens, "temperature": temperature, "stream": True,
                  "stream_options": {"include_usage": True}, "ignore_eos": ignore_eos}
    if chat:
        endpoint, body["messages"] = "/v1/chat/completions", [{"role": "user", "content": prompt}]
    else:
        endpoint, body["prompt"] = "/v1/completions", prompt
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    finish_reason, usage = None, None
    async with aiohttp.ClientSession() as session:
        async with session.post(url.rstrip("/") + endpoint, json=body, headers=headers) as resp:
            if resp.status != 200:
                print(f"error {resp.status}: {await resp.text()}", file=sys.stderr)
                return 1
            async for raw in resp.content:  # one SSE line at a time, as the server sends it
                line = raw.decode().strip()
                if not line.startswith("data: "):
                    continue
                data = line[len("data: "):]
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                usage = chunk.get("usage") or usage
                for choice in chunk["choices"]:
                    text = choice["delta"].get("content") if chat else choice["text"]
                    if text:
                        sys.stdout.write(text)
                        sys.stdout.flush()
                    finish_reason = choice.get("finish_reason") or finish_reason
    print()
    print(f"[finish_reason={finish_reason} usage={usage}]", file=sys.stderr)
    return 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default="http://127.0.0.1:8000", help="server base URL")
    ap.add_argument("--prompt", default="Hello, my name is")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--chat", action="store_true", help="use /v1/chat/completions")
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--ignore-eos", action="store_true", help="generate max_tokens even past end-of-sequence")
    args = ap.parse_args()
    sys.exit(asyncio.run(stream(args.url, args.prompt, args.max_tokens, args.temperature, args.chat, args.api_key,
                                args.ignore_eos)))


if __name__ == "__main__":
    main()
