"""`odmoe-chat`: talk to a running cluster through its OpenAI-compatible API; prompts are plain text.

    odmoe-chat                                   # interactive chat (chat template; /reset, /quit)
    odmoe-chat "def main():"                     # one-shot: the answer streams out, then it exits
    echo 'import os' | odmoe-chat -              # the prompt from stdin (any bytes of text)
    odmoe-chat --completion "def main():"        # continue raw text (/v1/completions), no template
    odmoe-chat --temperature 0.8 --seed 7 --max-tokens 64 --url https://10.0.0.1:8000 --key-dir DIR

A cluster with security on (the default) wants HTTPS and its token: `--key-dir DIR` reads both from
what `odmoe-keys init DIR` made (tls/cert.pem, token); or give `--token` (or the ODMOE_API_KEY
environment variable, as OpenAI clients take OPENAI_API_KEY) and `--cacert FILE`.

Nothing typed here goes through a config grammar. Exit codes: 0 success, 1 the cluster could not
answer (not reachable, overloaded, failed), 2 bad arguments or a request the server refused.
"""

from __future__ import annotations

import argparse
import json
import os
import ssl
import sys

import httpx

from odmoe.transport.security import ClientCredentials, SecurityError

DEFAULT_URL = "https://127.0.0.1:8000"


class ChatError(Exception):
    def __init__(self, message: str, code: int = 1):
        super().__init__(message)
        self.code = code


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="odmoe-chat", description="Chat with an odmoe cluster (OpenAI API).")
    p.add_argument(
        "prompt", nargs="*", help="one-shot prompt (plain text; '-' reads stdin); none: interactive"
    )
    p.add_argument("--url", default=DEFAULT_URL, help=f"main's HTTP API (default {DEFAULT_URL})")
    p.add_argument("--model", default="", help="model id (default: the one the cluster serves)")
    p.add_argument("--completion", action="store_true", help="continue raw text instead of chatting")
    p.add_argument("--system", default="", help="system message for chat")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 (default): greedy")
    p.add_argument("--top-p", type=float)
    p.add_argument("--top-k", type=int)
    p.add_argument("--min-p", type=float)
    p.add_argument("--repetition-penalty", type=float)
    p.add_argument("--seed", type=int)
    p.add_argument("--stop", action="append", default=[], help="a stop string (repeatable)")
    p.add_argument("--key-dir", help="the cluster's key directory (its tls/cert.pem and token)")
    p.add_argument("--token", default=os.environ.get("ODMOE_API_KEY"), help="bearer token ($ODMOE_API_KEY)")
    p.add_argument("--cacert", help="the cluster's TLS certificate (tls/cert.pem)")
    return p.parse_args(argv)


def http_client(args: argparse.Namespace) -> httpx.Client:
    """An HTTP client with the cluster's token and TLS trust, from --key-dir or --token/--cacert."""
    headers, verify = {}, True
    try:
        if args.key_dir:
            creds = ClientCredentials.from_key_dir(args.key_dir)
            headers["Authorization"] = f"Bearer {args.token or creds.token}"
            verify = creds.ssl_context()
        else:
            if args.token:
                headers["Authorization"] = f"Bearer {args.token}"
            if args.cacert:
                verify = ssl.create_default_context(cafile=args.cacert)
    except (SecurityError, OSError, ssl.SSLError) as exc:
        raise ChatError(str(exc), code=2) from None
    return httpx.Client(
        base_url=args.url.rstrip("/"), headers=headers, verify=verify, timeout=httpx.Timeout(10.0, read=None)
    )


class Session:
    def __init__(self, args: argparse.Namespace, out=sys.stdout):
        self.args, self.out = args, out
        self.http = http_client(args)
        self.model = args.model or self._served_model()
        self.history: list[dict] = [{"role": "system", "content": args.system}] if args.system else []

    def _served_model(self) -> str:
        try:
            reply = self.http.get("/v1/models")
        except httpx.HTTPError as exc:
            raise ChatError(
                f"no odmoe cluster answers at {self.args.url} ({exc}); start one with "
                "`odmoe-launch role=local serve=true` or pass --url"
            ) from None
        if reply.status_code == 401:
            raise ChatError(
                f"{self.args.url} refused us (401): pass --key-dir DIR, or --token and --cacert", code=2
            )
        if reply.status_code != 200:
            raise ChatError(f"{self.args.url}/v1/models answered {reply.status_code}: {reply.text[:200]}")
        return reply.json()["data"][0]["id"]

    def _body(self) -> dict:
        a = self.args
        body = {"model": self.model, "max_tokens": a.max_tokens, "temperature": a.temperature, "stream": True}
        optional = {
            "top_p": a.top_p,
            "top_k": a.top_k,
            "min_p": a.min_p,
            "repetition_penalty": a.repetition_penalty,
            "seed": a.seed,
            "stop": a.stop or None,
        }
        return {**body, **{k: v for k, v in optional.items() if v is not None}}

    def ask(self, text: str) -> str:
        """Send one prompt (or chat turn), stream the answer to `out`, return it."""
        if self.args.completion:
            path, body = "/v1/completions", {**self._body(), "prompt": text}
        else:
            self.history.append({"role": "user", "content": text})
            path, body = "/v1/chat/completions", {**self._body(), "messages": self.history}
        answer = "".join(self._stream(path, body))
        if not self.args.completion:
            self.history.append({"role": "assistant", "content": answer})
        return answer

    def _stream(self, path: str, body: dict):
        try:
            with self.http.stream("POST", path, json=body) as reply:
                if reply.status_code != 200:
                    reply.read()
                    raise ChatError(_error_text(reply), code=2 if reply.status_code in (400, 404) else 1)
                for line in reply.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[len("data: ") :])
                    if "error" in chunk:
                        raise ChatError(chunk["error"]["message"])
                    choice = chunk["choices"][0] if chunk.get("choices") else {}
                    piece = (
                        choice.get("text") if self.args.completion else choice.get("delta", {}).get("content")
                    )
                    if piece:
                        self.out.write(piece)
                        self.out.flush()
                        yield piece
        except httpx.HTTPError as exc:
            raise ChatError(f"lost the cluster at {self.args.url}: {exc}") from None


def _error_text(reply: httpx.Response) -> str:
    try:
        return f"{reply.status_code}: {reply.json()['error']['message']}"
    except (ValueError, KeyError, TypeError):
        return f"{reply.status_code}: {reply.text[:200]}"


def interactive(session: Session) -> None:
    print(
        f"odmoe-chat: {session.model} at {session.args.url}; /reset clears, /quit or Ctrl-D leaves",
        file=sys.stderr,
    )
    while True:
        try:
            text = input("you> ")
        except EOFError:
            print(file=sys.stderr)
            return
        if text.strip() in ("/quit", "/exit"):
            return
        if text.strip() == "/reset":
            session.history = session.history[:1] if session.args.system else []
            continue
        if not text.strip():
            continue
        try:
            session.ask(text)
        except ChatError as exc:
            print(f"\nodmoe-chat: {exc}", file=sys.stderr)
        print()


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    try:
        session = Session(args)
        if not args.prompt:
            interactive(session)
            return
        text = sys.stdin.read() if args.prompt == ["-"] else " ".join(args.prompt)
        session.ask(text)
        print()
    except ChatError as exc:
        print(f"odmoe-chat: {exc}", file=sys.stderr)
        sys.exit(exc.code)
    except KeyboardInterrupt:
        sys.exit(130)


if __name__ == "__main__":
    main()
