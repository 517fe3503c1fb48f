"""`attnslim bench`: sizes, KV bytes, FLOPs and speed of one or more models, interleaved in one run."""

from __future__ import annotations

import resource
from typing import Any

import torch

from attnslim.adapters import get_adapter
from attnslim.bench.flops import flops_per_token
from attnslim.bench.kv import kv_bytes_per_token
from attnslim.bench.speed import interleaved
from attnslim.errors import AttnslimError
from attnslim.modules.cpu_linear import cpu_linear_of

PROBE = "The quick brown fox jumps over the lazy dog. 1234 résumé naïve"


def check_same_tokenizer(tokenizers: dict[str, Any]) -> None:
    names = list(tokenizers)
    ref = tokenizers[names[0]](PROBE).input_ids
    for name in names[1:]:
        if tokenizers[name](PROBE).input_ids != ref or len(tokenizers[name]) != len(tokenizers[names[0]]):
            raise AttnslimError(
                f"{name} and {names[0]} use different tokenizers; speed and perplexity comparisons need the "
                "same tokenizer: compare a compressed model with the model it was compressed from"
            )


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def device_name(device: str) -> str:
    return torch.cuda.get_device_name(device) if device.startswith("cuda") else "cpu"


def bench_models(models: dict[str, tuple[Any, Any]], contexts: list[int], new_tokens: int = 32,
                 repeats: int = 5) -> dict[str, Any]:
    """Every model timed where it was placed (the CLI's --device / --offload), on the device of its embeddings."""
    check_same_tokenizer({n: tok for n, (_, tok) in models.items()})
    devices = {str(m.get_input_embeddings().weight.device) for m, _ in models.values()}
    if len(devices) != 1:
        raise AttnslimError(f"bench: the models sit on different devices ({sorted(devices)}); place them alike")
    device = devices.pop()
    for model, _ in models.values():
        model.eval()
    out: dict[str, Any] = {"device": f"{device} ({device_name(device)})",
                           "threads": torch.get_num_threads(), "sizes": {},
                           "cpu_linear": ",".join(sorted({cpu_linear_of(m) for m, _ in models.values()}))}
    for name, (model, _) in models.items():
        out["sizes"][name] = {
            "params": get_adapter(model).param_groups(),
            "kv_bytes_per_token": kv_bytes_per_token(model)["total"],
            "flops_per_token": {str(c): flops_per_token(model, c)["total"] for c in contexts},
        }
    out["speed"] = interleaved({n: m for n, (m, _) in models.items()}, contexts, new_tokens, repeats)
    out["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return out


def format_bench(result: dict[str, Any]) -> str:
    speed = result["speed"]
    linears = "" if result.get("cpu_linear", "torch") == "torch" else f"; linear layers on {result['cpu_linear']}"
    lines = [f"device: {result['device']} ({result['threads']} threads{linears}); medians of {speed['repeats']} "
             f"interleaved repetitions; ratios vs {speed['reference']}"]
    for name, size in result["sizes"].items():
        p = size["params"]
        lines.append(f"{name}: params total {p['total']:,} (attention {p['attention']:,}, mlp {p['mlp']:,}); "
                     f"KV {size['kv_bytes_per_token']:,.0f} B/token")
        for ctx, row in speed["models"][name].items():
            low, high = row["decode_ratio_span"]
            span = f", repetitions {low:.2f}-{high:.2f}x" if name != speed["reference"] else ""
            lines.append(
                f"  context {ctx:>5}: prefill {row['prefill_s'] * 1000:8.1f} ms ({row['prefill_ratio']:.2f}x)  "
                f"decode {row['decode_tok_s']:7.1f} tok/s ({row['decode_ratio']:.2f}x{span})  "
                f"FLOPs/token {size['flops_per_token'][ctx]:.3g}"
            )
    lines.append(f"peak RSS {result['peak_rss_mb']:.0f} MB")
    return "\n".join(lines)
