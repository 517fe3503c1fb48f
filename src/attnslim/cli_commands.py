"""The subcommands of `attnslim` (each a few lines over the API)."""

from __future__ import annotations

import argparse
from typing import Any

from attnslim.cli import DEFAULT_MODEL, command, emit_json, parse_sources


def add_parsers(sub: Any) -> None:
    p = sub.add_parser("eval", help="perplexity (and params / KV bytes) of a model")
    p.add_argument("model", nargs="?", default=DEFAULT_MODEL)
    p.add_argument("--data", default="wiki,ptb,c4")
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--json", action="store_true")

    p = sub.add_parser("inspect", help="parameters per group, KV bytes/token, per-layer attention")
    p.add_argument("model", nargs="?", default=DEFAULT_MODEL)
    p.add_argument("--json", action="store_true")


@command("eval")
def cmd_eval(args: argparse.Namespace) -> int:
    from attnslim.adapters import get_adapter
    from attnslim.bench import kv_bytes_per_token
    from attnslim.data import check_lengths, eval_windows
    from attnslim.eval import perplexity
    from attnslim.models import load_model

    sources = parse_sources(args.data)
    check_lengths(args.seq_len, args.tokens)
    model, tokenizer = load_model(args.model)
    ppl, tokens = {}, {}
    for source in sources:
        result = perplexity(model, eval_windows(source, tokenizer, args.tokens, args.seq_len))
        ppl[source], tokens[source] = result.ppl, result.predicted_tokens
        print(f"{source:>6}: ppl {result.ppl:9.3f}  ({result.description})", flush=True)
    params = get_adapter(model).param_groups()
    kv = kv_bytes_per_token(model)["total"]
    print(f"params: {params['total']:,}  KV cache: {kv:,.0f} bytes/token")
    if args.json:
        emit_json({
            "model": args.model, "ppl": ppl, "tokens": tokens, "seq_len": args.seq_len,
            "params": {k: params[k] for k in ("total", "attention", "mlp", "embedding")},
            "kv_bytes_per_token": kv,
        })
    return 0


@command("inspect")
def cmd_inspect(args: argparse.Namespace) -> int:
    from attnslim.inspect import format_inspection, inspect_model
    from attnslim.models import load_model

    model, _ = load_model(args.model)
    info = inspect_model(model)
    print(format_inspection(info))
    if args.json:
        emit_json(info)
    return 0
