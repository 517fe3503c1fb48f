"""The arguments of every `attnslim` subcommand (argparse); the commands themselves are in cli_commands.py (export,
serve), cli_measure.py, cli_compress.py and cli_analyze.py."""

from __future__ import annotations

import argparse
import textwrap
from pathlib import Path
from typing import Any

DEFAULT_MODEL = "smollm2-135m"
# the parser is built at every command, so it imports nothing heavy: these two are kept equal to models.ZOO and
# recipe.RECIPES_DIR by tests/test_cli_help.py
PACKAGED_MODELS = ("smollm2-135m", "gemma3-270m", "qwen2.5-1.5b")
RECIPES_DIR = Path(__file__).parent / "recipes"

# one example per command, shown under its --help (and checked to parse by tests/test_cli_help.py)
EXAMPLES = {
    "eval": "attnslim eval out/mla --data wiki,c4 --tokens 4096",
    "tasks": "attnslim tasks --path",
    "recipes": "attnslim recipes --json",
    "compress": "attnslim compress smollm2-135m --recipe mla --out out/mla",
    "plan": "attnslim plan smollm2-135m --kv 0.5 --out plan.yaml",
    "generate": "attnslim generate out/mla --prompt 'The history of'",
    "demo": "attnslim demo --out out/demo",
    "analyze": "attnslim analyze smollm2-135m --what linearity --plot linearity.svg",
    "bench": "attnslim bench out/mla --vs smollm2-135m --contexts 512,2048",
    "report": "attnslim report out/mla",
    "inspect": "attnslim inspect out/mla",
    "export": "attnslim export out/mla-deepseek --to deepseek-v3 --out out/mla-deepseek-v3",
    "serve": "attnslim serve out/nbl --port 8000",
}


def model_help(compressed: bool | None) -> str:
    """What MODEL may be, for a command that reads an attnslim output (`compressed`), one that refuses it (False), or
    one that reads what load_model reads without saying more (None)."""
    outputs = {True: ", or an attnslim output directory", None: "",
               False: "; not an attnslim output (compress the original model, with every step in one recipe)"}
    return (f"a packaged model name ({', '.join(PACKAGED_MODELS)}; default {DEFAULT_MODEL}), a local Hugging Face "
            f"directory of safetensors weights, or a hub id org/name when the hub is reachable{outputs[compressed]}")


def compress_description() -> str:
    names = ", ".join(sorted(p.stem for p in RECIPES_DIR.glob("*.yaml")))
    paragraphs = ("Compress MODEL with a recipe and save the result to --out (loadable by attnslim.load and by "
                  "transformers with trust_remote_code).",
                  f"Packaged recipes (--recipe NAME): {names}. `attnslim recipes` gives each one's purpose and what "
                  "was measured of it; --recipe also takes a YAML path.",
                  "MODEL: " + model_help(compressed=False) + ".")
    return "\n\n".join(textwrap.fill(text, 100, break_on_hyphens=False) for text in paragraphs)


def add_examples(sub: Any) -> None:
    """Every subcommand's --help ends with its example; descriptions and examples keep their line breaks."""
    for name, parser in sub.choices.items():
        parser.formatter_class = argparse.RawDescriptionHelpFormatter
        parser.epilog = f"example:\n  {EXAMPLES[name]}"


def kv_lora_rank_arg(text: str) -> int | str:
    """--kv-lora-rank: `auto` or a whole number (whether vLLM serves it is export's check, which names the ranks)."""
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        import argparse

        raise argparse.ArgumentTypeError(f"{text!r} is neither `auto` nor a whole number (e.g. 256 or 512)") from None


def add_placement(p: Any, what: str) -> None:
    """--offload / --device of the commands that run a model (eval, generate, bench)."""
    p.add_argument("--offload", action="store_true", help=f"keep each decoder layer's weights on disk and read them "
                   f"while the layer runs: {what} a model larger than memory (local safetensors directories)")
    p.add_argument("--device", default=None, help="cpu | cuda | cuda:N (default: cuda when present, else cpu)")
    p.add_argument("--cpu-linear", default="torch", choices=("torch", "onednn"),
                   help="float32 linear layers on the CPU: torch's default (MKL), or oneDNN, faster on CPUs where MKL "
                   "runs generic code (AMD); every model of the command alike (modules/cpu_linear.py)")


def add_plan_options(p: Any) -> None:
    """The planner's options beside its KV budget (`plan`, `compress --kv`)."""
    p.add_argument("--params", type=float, default=None, help="also keep at most this fraction of the parameters")
    p.add_argument("--decode-bytes", type=float, default=None, help="also read at most this fraction of the bytes "
                   "a dense decode step reads at --decode-at tokens of context")
    p.add_argument("--decode-at", type=int, default=4096, help="context of --decode-bytes (default 4096)")
    p.add_argument("--engine", default="hf", choices=("hf", "vllm"), help="hf: every candidate; vllm: a plan one vLLM "
                   "route serves: keep/nbl/drop (attnslim's plugin: Llama, Qwen2) or MLA at every layer (stock "
                   "vLLM's DeepSeek-V3 kernels: widths 320/576)")
    p.add_argument("--candidates", default=None, help="comma-separated kinds among keep,mla,nbl,drop,ds (default all)")
    p.add_argument("--ladder", default=None, help="mla's kept KV fractions per layer, comma-separated "
                   "(default 0.125,0.25,0.375,0.5,0.625,0.75)")
    p.add_argument("--calib-source", default=None, help="calibration text (fits and costs; never evaluation "
                   "text; default self+wiki: half sampled by the dense model itself, which keeps a model's own "
                   "domain (code, another language) better than wiki alone; wiki with --offload); also wiki, "
                   "wiki+file:PATH, self (docs/planning.md)")
    p.add_argument("--heal", action="store_true", help="end the plan with the default recipe's 40-step heal (on "
                   "the calibration source when it includes 'self' or a file:PATH, the model's own text)")
    p.add_argument("--calib-windows", type=int, default=32, help="fit windows of 512 tokens (what compress uses)")
    p.add_argument("--score-windows", type=int, default=4, help="windows of 256 tokens each layer's cost is "
                   "measured on, and the whole plan's (held out)")
    p.add_argument("--rounds", type=int, default=4, help="refinement rounds on the whole plan's cost (0: none)")
    p.add_argument("--local-steps", type=int, default=0, help="train each mla candidate's attention this many steps "
                   "towards the dense attention's output, as recipes/mla-kv25.yaml does (96 there), when it is "
                   "measured and in the plan's mla steps (0: off; several times slower: docs/planning.md)")
    p.add_argument("--fit-steps", type=int, default=0, help="after planning, train each chosen mla layer's attention "
                   "this many steps towards the dense attention's output (96 in recipes/mla-kv25.yaml; costs are "
                   "measured without it, so planning takes no longer; compression does: docs/planning.md)")


def add_compute(p: Any, where: str, dtype_note: str) -> None:
    """--device / --dtype of the commands that build a model (compress, plan)."""
    p.add_argument("--device", default="cpu", help=f"where {where}: cpu | cuda | cuda:N (statistics stay float64)")
    p.add_argument("--dtype", default="float32", help=f"compute dtype: float32 | bfloat16 | float16 ({dtype_note})")


def add_parsers(sub: Any) -> None:
    p = sub.add_parser("eval", help="perplexity and/or zero-shot tasks (and params / KV bytes) of a model")
    p.add_argument("model", nargs="?", default=DEFAULT_MODEL, help=model_help(compressed=True))
    p.add_argument("--data", default=None, help="text sources for perplexity (default wiki,ptb,c4 without --tasks)")
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--tasks", default=None, help="zero-shot tasks, comma-separated: lm-eval's "
                   "standard tasks (arc_easy, piqa, ..., mmlu; `standard` = the 8-task suite) scored by lm-eval "
                   "itself, and the home-made attnslim_* tasks (see `attnslim tasks`)")
    p.add_argument("--limit", type=int, default=None, help="first N items of each task (as lm_eval "
                   "--limit; MMLU: of each subject); a task with fewer items is scored whole, and said so")
    p.add_argument("--batch-size", type=int, default=16, help="task batch size (as lm_eval --batch_size)")
    p.add_argument("--choice", type=int, default=None, metavar="N", help="N next-word items from the evaluation "
                   "split of --choice-source, answer read at the last prompt position (eval/choice.py): leak-free, "
                   "the only score for ATP's non-causal paper layer")
    p.add_argument("--choice-context", type=int, default=256, help="prompt tokens of the --choice items")
    p.add_argument("--choice-source", default="wiki", help="text of the --choice items: wiki, ptb, c4, file:PATH")
    p.add_argument("--json", action="store_true")
    add_placement(p, "evaluate")

    p = sub.add_parser("tasks", help="list the zero-shot tasks; --path prints the lm-eval --include_path")
    p.add_argument("--path", action="store_true", help="write (once, in the attnslim cache) and print the folder "
                   "for `lm_eval --include_path`: lm-eval's task YAMLs pointed at the local data")

    p = sub.add_parser("recipes", help="list the packaged recipes: each one's purpose and what was measured of it")
    p.add_argument("--results", type=Path, default=None, help="benchmark results to read the measurements from "
                   "(default: the source checkout's benchmarks/results)")
    p.add_argument("--json", action="store_true")

    p = sub.add_parser("compress", help="compress a model with a recipe and save it",
                       description=compress_description())
    p.add_argument("model", nargs="?", default=DEFAULT_MODEL, help=model_help(compressed=False))
    p.add_argument("--recipe", default=None, help="a packaged recipe's name (listed above; `attnslim recipes`) or a "
                   "YAML path (default: default)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a recipe key")
    p.add_argument("--kv", type=float, default=None, help="instead of a recipe: plan one for this kept fraction of "
                   "the dense KV cache (as `attnslim plan`), then compress with it; the plan goes into "
                   "compression.json")
    add_plan_options(p)
    p.add_argument("--out", required=True)
    p.add_argument("--overwrite", action="store_true")
    p.add_argument("--offload", action="store_true", help="keep the weights on disk and compress one decoder layer "
                   "at a time, writing the output shard by shard (chosen automatically when the model does not fit)")
    add_compute(p, "each layer is calibrated and converted", "also the saved weights' dtype")
    p.add_argument("--json", action="store_true")

    p = sub.add_parser("plan", help="choose per layer among keep, MLA widths, NBL, drop and sharing under budgets; "
                       "write the plan as a recipe")
    p.add_argument("model", nargs="?", default=DEFAULT_MODEL, help=model_help(compressed=False))
    p.add_argument("--kv", type=float, required=True, help="kept fraction of the dense KV cache, in (0, 1]")
    add_plan_options(p)
    p.add_argument("--out", required=True, help="the plan's recipe (.yaml); its report is written beside it "
                   "(.report.json)")
    add_compute(p, "the model is held and every candidate measured (the whole model moves there)",
                "a 7B-8B model plans in bfloat16 on one GPU")
    p.add_argument("--offload", action="store_true", help="keep the weights on disk and read one decoder layer at a "
                   "time (local safetensors directories): plan a model larger than memory; sharing (ds) is not "
                   "offered")
    p.add_argument("--json", action="store_true")

    p = sub.add_parser("generate", help="greedy generation with the KV cache")
    p.add_argument("model", nargs="?", default=DEFAULT_MODEL, help=model_help(compressed=True))
    p.add_argument("--prompt", required=True)
    p.add_argument("--max-new-tokens", type=int, default=40)
    add_placement(p, "generate with")

    p = sub.add_parser("demo", help="compress the default model with recipes/default.yaml and compare")
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--recipe", default="default")
    p.add_argument("--out", default="out/demo")
    p.add_argument("--overwrite", action="store_true", help="replace --out if it is an earlier attnslim output")
    p.add_argument("--tokens", type=int, default=1024, help="perplexity tokens per text")
    p.add_argument("--task-limit", type=int, default=None, help="items per zero-shot task (0: every item; default: "
                   "demo.TASK_LIMIT)")

    p = sub.add_parser("analyze", help="the papers' motivating analyses on a model")
    p.add_argument("model", nargs="?", default=DEFAULT_MODEL, help=model_help(compressed=None))
    p.add_argument("--what", required=True, help="linearity (NBL) | lowrank (ATP) | similarity | sensitivity (LISA) "
                   "| conversion (per-layer cost of --method, each layer converted alone)")
    p.add_argument("--m", type=int, default=6, help="linearity: how many layers to select")
    p.add_argument("--method", default="atp", help="conversion: a statistics-free method (default atp)")
    p.add_argument("--arg", action="append", default=[], metavar="KEY=VALUE",
                   help="conversion: a method argument, value parsed as YAML (e.g. --arg value_scale=inv_sqrt_len)")
    p.add_argument("--layers", default="all", help="conversion: the layers to measure, a recipe selector: all, a "
                   "slice '4:28', or indices '5,11,17' (e.g. Gemma-3's full-attention layers, which atp needs)")
    p.add_argument("--windows", type=int, default=32,
                   help="calibration windows (similarity and lowrank read at most 8, sensitivity 4; said when capped)")
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--source", default="wiki")
    p.add_argument("--json", action="store_true")
    p.add_argument("--plot", default=None, help="also write the analysis' figures to this SVG file")

    p = sub.add_parser("bench", help="params, KV bytes, FLOPs, prefill/decode speed (interleaved vs --vs)")
    p.add_argument("model", nargs="?", default=DEFAULT_MODEL, help=model_help(compressed=True))
    p.add_argument("--vs", default=None, help="reference model (default: none; ratios need one)")
    p.add_argument("--contexts", default="512,2048")
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", action="store_true")
    add_placement(p, "time")

    p = sub.add_parser("report", help="write report.html and report.md into a compressed directory")
    p.add_argument("directory")

    p = sub.add_parser("inspect", help="parameters per group, KV bytes/token, per-layer attention")
    p.add_argument("model", nargs="?", default=DEFAULT_MODEL, help=model_help(compressed=True))
    p.add_argument("--json", action="store_true")

    p = sub.add_parser("export", help="write an output as a stock checkpoint other engines load without attnslim: "
                       "all-MLA as DeepSeek-V3 (transformers and vLLM), kept/dropped attention as DeciLM (vLLM)")
    p.add_argument("directory", help="an attnslim output: every layer mla/transmla (layout: deepseek) for "
                   "deepseek-v3; drop steps only for deci")
    p.add_argument("--to", required=True, choices=["deepseek-v3", "deci"], help="the target format: deepseek-v3 "
                   "(DeepseekV3ForCausalLM) or deci (DeciLMForCausalLM, model_type nemotron-nas: vLLM builds no "
                   "attention and no KV cache for a dropped layer; serve with --trust-remote-code for its config), "
                   "e.g. attnslim export out/drop --to deci --out out/drop-deci")
    p.add_argument("--out", required=True)
    p.add_argument("--overwrite", action="store_true")
    p.add_argument("--kv-lora-rank", type=kv_lora_rank_arg, default=None, help="deepseek-v3: pad every latent "
                   "(exactly, with zeros) to a width vLLM serves: `auto` picks the smallest, kv_lora_rank 256 (width "
                   "320 with the 64-dim rotary key) where the latent fits, else 512 (width 576); or give 256 or 512. "
                   "vLLM's CPU kernel runs only 512. Default: the latent's own rank (transformers loads any; vLLM "
                   "does not)")
    p.add_argument("--dtype", default="float32", help="saved weights: float32 | bfloat16 (deci: also float16)")
    p.add_argument("--drop-biases", action="store_true", help="deepseek-v3: drop attention biases DeepSeek-V3 "
                   "cannot hold (the cost is measured and written to attnslim-export.json)")
    p.add_argument("--json", action="store_true")

    p = sub.add_parser("serve", help="serve a model (dense, or an nbl / drop output) with vLLM's OpenAI-compatible "
                       "server (needs `make serve-setup`)")
    p.add_argument("model", help="a compressed directory, a checkpoint directory or a zoo name")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only; "
                   "any other host needs a key or --no-api-key)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key-file", type=Path, default=None, help="clients must send the key in this file (its "
                   "first line; keep it mode 600). The key can also come from VLLM_API_KEY in the environment")
    p.add_argument("--api-key", default=None, help="clients must send this key; visible to other users in `ps` "
                   "until vLLM starts: prefer --api-key-file or VLLM_API_KEY")
    p.add_argument("--no-api-key", action="store_true", help="serve a non-loopback --host without a key, on purpose")
    p.add_argument("--dtype", default="auto", help="vLLM's --dtype: auto | float32 | float | bfloat16 | float16 | half")
    p.add_argument("--max-model-len", type=int, default=None, help="longest sequence (default and maximum: the "
                   "model's max_position_embeddings)")
    p.add_argument("--kv-cache-gib", type=float, default=4.0, help="KV cache size on CPU in whole GiB "
                   "(VLLM_CPU_KVCACHE_SPACE)")
    p.add_argument("--enforce-eager", action="store_true", help="vLLM's --enforce-eager: skip its graph compilation, "
                   "so the server starts sooner and decodes slower; for trials")
