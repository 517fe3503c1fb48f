"""The command table of `attnslim` and what its commands share (`command`, `emit_json`, `parse_ints`,
`load_placed`), with `export` and `serve`. The other commands are grouped by what they do: cli_measure.py (eval,
tasks, inspect, generate, bench, report), cli_compress.py (recipes, compress, plan, demo), cli_analyze.py (analyze);
their arguments are declared in cli_parsers.py."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from typing import Any

from attnslim.errors import AttnslimError

COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {}


def command(name: str) -> Callable[[Callable[[argparse.Namespace], int]], Callable[[argparse.Namespace], int]]:
    def deco(fn: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
        COMMANDS[name] = fn
        return fn

    return deco


def emit_json(obj: Any) -> None:
    print(json.dumps(obj, default=float), flush=True)


def parse_ints(flag: str, text: str) -> list[int]:
    """Comma-separated ints ("512,2048"), or an error naming the flag."""
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise AttnslimError(f"{flag} {text!r}: expected comma-separated integers, e.g. 512,2048") from None


def load_placed(name: str, args: argparse.Namespace) -> tuple[Any, Any]:
    """A model on --device (whole, or one decoder layer at a time with --offload), its linear layers on
    --cpu-linear."""
    from attnslim.bench.report import default_device
    from attnslim.models import load_model
    from attnslim.modules.cpu_linear import set_cpu_linear
    from attnslim.offload import resolve_device

    device = resolve_device(args.device or default_device())
    if args.offload:
        if args.cpu_linear != "torch":
            raise AttnslimError(f"--cpu-linear {args.cpu_linear} with --offload is not supported: the offloaded "
                                "layers' weights arrive per call; drop one of the two")
        return load_model(name, offload=True, device=device)
    model, tokenizer = load_model(name)
    model = model.to(device)
    if args.cpu_linear != "torch":
        set_cpu_linear(model, args.cpu_linear)
    return model, tokenizer


@command("export")
def cmd_export(args: argparse.Namespace) -> int:
    from pathlib import Path

    from attnslim.outdir import check_output

    source, out = Path(args.directory), Path(args.out)
    check_output(out, args.overwrite, inputs=[source])  # before loading: a bad --out is found in a second
    report = _export_deci(source, out, args) if args.to == "deci" else _export_deepseek(source, out, args)
    if args.json:
        emit_json({"out": str(out), **report})
    return 0


def _export_deepseek(source: Any, out: Any, args: argparse.Namespace) -> dict[str, Any]:
    from attnslim.export import ExportOptions, export_deepseek
    from attnslim.export.deepseek import check_kv_lora_rank_in
    from attnslim.io import load

    options = ExportOptions(kv_lora_rank=args.kv_lora_rank, dtype=args.dtype, drop_biases=args.drop_biases)
    check_kv_lora_rank_in(source, args.kv_lora_rank)  # before loading too
    model, tokenizer = load(source)
    report = export_deepseek(model, tokenizer, out, options, args.overwrite, source)
    kv, dense = report["kv_elements_per_token_and_layer"], report["dense_kv_elements_per_token_and_layer"]
    print(f"wrote {out} (DeepseekV3ForCausalLM, kv_lora_rank {report['kv_lora_rank']} + qk_rope_head_dim "
          f"{report['qk_rope_head_dim']}: KV {kv} values per token and layer, {kv / dense:.3f}x the dense {dense}; "
          f"{args.dtype}); verified by transformers on {report['verified_on']}: "
          f"relative logit error {report['relative_logit_error']:.1e}, top-1 agreement "
          f"{report['top1_agreement']:.3f}, NLL {report['nll_source']:.4f} -> {report['nll_export']:.4f}")
    return report


def _export_deci(source: Any, out: Any, args: argparse.Namespace) -> dict[str, Any]:
    from attnslim.export import export_deci
    from attnslim.export.deci_check import check_directory
    from attnslim.io import load

    for flag, given in (("--kv-lora-rank", args.kv_lora_rank is not None), ("--drop-biases", args.drop_biases)):
        if given:
            raise AttnslimError(f"{flag} is an option of --to deepseek-v3; --to deci copies every tensor as it is")
    check_directory(source)  # every refusal before loading
    model, tokenizer = load(source)
    report = export_deci(model, tokenizer, out, args.dtype, args.overwrite, source)
    print(f"wrote {out} (DeciLMForCausalLM, {args.dtype}): no attention and no KV cache in layers "
          f"{report['no_op_attention_layers']}, {report['kv_cache_layers']} of {report['dense_kv_cache_layers']} "
          f"layers cache KV ({report['kv_tokens_vs_dense']:.3f}x the dense tokens in the same cache); serve it with "
          f"`attnslim serve {out}` or vLLM with --trust-remote-code (vLLM's own model; the remote code is its config "
          "class)")
    return report


@command("serve")
def cmd_serve(args: argparse.Namespace) -> int:
    from attnslim.serving.launch import ServeArgs, serve

    serve(ServeArgs(args.model, args.host, args.port, args.api_key, args.dtype, args.max_model_len, args.kv_cache_gib,
                    args.api_key_file, args.no_api_key, args.enforce_eager))
    return 0  # not reached: serve() execs vLLM
