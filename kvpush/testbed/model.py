"""`kvpush model tiny DIR`: build a small random-weight model, fully offline.

The model is a Qwen2-architecture decoder (or, with --arch deepseek_v2, a DeepSeek-V2
style one with multi-head latent attention, MLA; or, with --arch llama, a Llama one, whose
layers can alternate sliding-window and full attention with --sliding-window, as gpt-oss
and Gemma 3 do, or all be windowed with --every-layer-windowed too; or, with --arch
qwen3_next, a Qwen3-Next one, whose layers are three gated-delta-net linear-attention
layers, each keeping one state per request, to every full-attention one) with random
weights and a byte-level BPE tokenizer trained locally on a synthetic corpus. Its outputs
are gibberish but deterministic at temperature 0, which is what equality tests need. The
shape flags let a benchmark choose how many KV bytes each token carries:
    qwen2, llama: kv_bytes_per_token = layers * 2 (K and V) * kv_heads * head_dim * dtype_bytes
    deepseek_v2: kv_bytes_per_token = layers * (512 latent + 64 rotary) * dtype_bytes
    qwen3_next: the full-attention layers' (every fourth) as qwen2's, plus a state per
    request in each linear-attention layer (its heads: --kv-heads keys, --heads values,
    of 128 dims, the only size vLLM's CPU kernel runs)
(MLA's latent width is fixed at DeepSeek's 512 + 64, the only one vLLM's CPU kernel runs;
--head-dim sets its per-head query/value width, and --kv-heads is not used.)
"""

from __future__ import annotations

import json
import random
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
ARCHS = ("qwen2", "llama", "deepseek_v2", "qwen3_next")
LINEAR_HEAD_DIM = 128  # qwen3_next: vLLM's CPU gated-delta-net kernel runs this head size
MLA_LATENT, MLA_ROPE = 512, 64

# Words that make prompts such as "Tell me about the weather" tokenize into few tokens.
_COMMON_WORDS = """
the of and to a in is it you that he was for on are with as I his they be at one have
this from or had by hot word but what some we can out other were all there when up use
your how said an each she which do their time if will way about many then them write
would like so these her long make thing see him two has look more day could go come did
number sound no most people my over know water than call first who may down side been
now find any new work part take get place made live where after back little only round
man year came show every good me give our under name very through just form sentence
great think say help low line differ turn cause much mean before move right boy old too
same tell does set three want air well also play small end put home read hand port large
spell add even land here must big high such follow act why ask men change went light
kind off need house picture try us again animal point mother world near build self earth
father head stand own page should country found answer school grow study still learn
plant cover food sun four between state keep eye never last let thought city tree cross
farm hard start might story saw far sea draw left late run while press close night real
life few north open seem together next white children begin got walk example ease paper
group always music those both mark often letter until mile river car feet care second
book carry took science eat room friend began idea fish mountain stop once base hear
horse cut sure watch color face wood main enough plain girl usual young ready above ever
red list though feel talk bird soon body dog family direct pose leave song measure door
product black short numeral class wind question happen complete ship area half rock
order fire south problem piece told knew pass since top whole king space heard best hour
better true during hundred five remember step early hold west ground interest reach fast
verb sing listen six table travel less morning ten simple several vowel toward war lay
against pattern slow center love person money serve appear road map rain rule govern
pull cold notice voice unit power town fine certain fly fall lead cry dark machine note
wait plan figure star box noun field rest correct able pound done beauty drive stood
contain front teach week final gave green oh quick develop ocean warm free minute strong
special mind behind clear tail produce fact street inch multiply nothing course stay
wheel full force blue object decide surface deep moon island foot system busy test
record boat common gold possible plane stead dry wonder laugh thousand ago ran check
game shape equate miss brought heat snow tire bring yes distant fill east paint language
among hello weather model cache token prefill decode transfer push pull request server
block memory
""".split()  # noqa: SIM905 - one word per line would be unreadable

CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


@dataclass(frozen=True, slots=True)
class TinyModelSpec:
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 32
    intermediate_size: int = 256
    vocab_size: int = 1024
    max_positions: int = 32768
    dtype: str = "bfloat16"
    seed: int = 0
    arch: str = "qwen2"
    sliding_window: int = 0  # llama: every other layer, from the first, attends this far back
    every_layer_windowed: bool = False  # with sliding_window: every layer, as Mistral 7B v0.1

    def __post_init__(self) -> None:
        for name in ("layers", "heads", "kv_heads", "head_dim", "intermediate_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 1")
        if self.heads % self.kv_heads:
            raise ValueError(
                f"--heads ({self.heads}) must be a multiple of --kv-heads ({self.kv_heads})"
            )
        if self.vocab_size < 300:
            raise ValueError("--vocab-size must be at least 300 (256 bytes + merges + specials)")
        if self.arch not in ARCHS:
            raise ValueError(f"--arch must be one of {ARCHS}, got {self.arch!r}")
        if self.sliding_window < 0:
            raise ValueError("--sliding-window must be 0 (none) or a number of tokens")
        if self.sliding_window and self.arch != "llama":
            raise ValueError(
                f"--sliding-window needs --arch llama (vLLM's {self.arch} runs every layer "
                "with full attention)"
            )
        if self.every_layer_windowed and not self.sliding_window:
            raise ValueError("--every-layer-windowed needs --sliding-window")
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"--dtype must be one of {sorted(DTYPE_BYTES)}, got {self.dtype!r}")

    @property
    def hidden_size(self) -> int:
        return self.heads * self.head_dim

    @property
    def layer_types(self) -> list[str]:
        """Per layer, as Hugging Face configs say it: windowed layers alternate with full
        (or, `every_layer_windowed`, are all there is)."""
        if self.arch == "qwen3_next":  # as Qwen3-Next: every fourth layer attends
            return [("linear_attention", "full_attention")[i % 4 == 3] for i in range(self.layers)]
        if not self.sliding_window:
            return ["full_attention"] * self.layers
        if self.every_layer_windowed:
            return ["sliding_attention"] * self.layers
        return [("sliding_attention", "full_attention")[i % 2] for i in range(self.layers)]

    @property
    def kv_bytes_per_token(self) -> int:
        if self.arch == "deepseek_v2":
            return self.layers * (MLA_LATENT + MLA_ROPE) * DTYPE_BYTES[self.dtype]
        if self.arch == "qwen3_next":
            full = self.layer_types.count("full_attention")
            return full * 2 * self.kv_heads * self.head_dim * DTYPE_BYTES[self.dtype]
        return self.layers * 2 * self.kv_heads * self.head_dim * DTYPE_BYTES[self.dtype]


def synthetic_corpus(seed: int, lines: int = 4000) -> list[str]:
    """Deterministic training text: common words plus pseudo-words from a seeded RNG."""
    rng = random.Random(seed)
    syllables = [c + v for c in "bcdfghklmnprstvwz" for v in "aeiou"]
    pseudo = ["".join(rng.choices(syllables, k=rng.randint(1, 3))) for _ in range(600)]
    vocabulary = list(_COMMON_WORDS) * 3 + pseudo
    text = []
    for _ in range(lines):
        words = rng.choices(vocabulary, k=rng.randint(4, 16))
        text.append(" ".join(words).capitalize() + rng.choice(".?!,;:") + f" {rng.randint(0, 999)}")
    return text


def build_tokenizer(spec: TinyModelSpec, out: Path) -> tuple[int, int]:
    """Train and save the tokenizer; returns (vocab size, end-of-text token id)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=spec.vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(synthetic_corpus(spec.seed), trainer=trainer)
    tokenizer.save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": "<|endoftext|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "model_max_length": spec.max_positions,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    (out / "special_tokens_map.json").write_text(
        json.dumps({"eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>"}, indent=2)
    )
    eos = tokenizer.token_to_id(SPECIAL_TOKENS[0])
    assert eos is not None, "special tokens are added by the trainer"
    return int(tokenizer.get_vocab_size()), int(eos)


def build_tiny_model(out: Path, spec: TinyModelSpec) -> dict[str, Any]:
    """Write config, random weights and tokenizer to `out`; returns a summary."""
    import torch
    import transformers

    out.mkdir(parents=True, exist_ok=True)
    vocab, eos = build_tokenizer(spec, out)
    common: dict[str, Any] = {
        "vocab_size": vocab,
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.layers,
        "num_attention_heads": spec.heads,
        "max_position_embeddings": spec.max_positions,
        "tie_word_embeddings": False,
        "initializer_range": 0.2,
        "bos_token_id": eos,
        "eos_token_id": eos,
        "dtype": spec.dtype,
    }
    config: transformers.PretrainedConfig
    model_class: type[transformers.PreTrainedModel]
    if spec.arch == "deepseek_v2":
        config = transformers.DeepseekV2Config(
            **common,
            num_key_value_heads=spec.heads,
            kv_lora_rank=MLA_LATENT,
            qk_rope_head_dim=MLA_ROPE,
            q_lora_rank=None,
            qk_nope_head_dim=spec.head_dim,
            v_head_dim=spec.head_dim,
            # dense MLPs only: a few (unused) experts satisfy the config's types
            n_routed_experts=4,
            num_experts_per_tok=2,
            n_shared_experts=1,
            moe_intermediate_size=spec.intermediate_size // 4,
            first_k_dense_replace=spec.layers,
        )
        model_class = transformers.DeepseekV2ForCausalLM
    elif spec.arch == "llama":
        # not LlamaConfig's own fields: kept in config.json, where vLLM's Llama reads them
        # per layer (the way gpt-oss and Gemma 3 interleave their windows)
        windows: dict[str, Any] = {
            "layer_types": spec.layer_types, "sliding_window": spec.sliding_window or None
        }
        config = transformers.LlamaConfig(
            **common, **windows, num_key_value_heads=spec.kv_heads, head_dim=spec.head_dim
        )
        model_class = transformers.LlamaForCausalLM
    elif spec.arch == "qwen3_next":
        config = transformers.Qwen3NextConfig(
            **common,
            num_key_value_heads=spec.kv_heads,
            head_dim=spec.head_dim,
            layer_types=spec.layer_types,
            linear_num_key_heads=spec.kv_heads,
            linear_num_value_heads=spec.heads,
            linear_key_head_dim=LINEAR_HEAD_DIM,
            linear_value_head_dim=LINEAR_HEAD_DIM,
            linear_conv_kernel_dim=4,
            # its MLPs are experts: a few small ones, as the model runs them
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=spec.intermediate_size // 2,
            shared_expert_intermediate_size=spec.intermediate_size // 2,
        )
        model_class = transformers.Qwen3NextForCausalLM
    else:
        config = transformers.Qwen2Config(**common, num_key_value_heads=spec.kv_heads)
        model_class = transformers.Qwen2ForCausalLM
    torch.manual_seed(spec.seed)
    model = model_class(config).to(getattr(torch, spec.dtype))
    model.save_pretrained(str(out), safe_serialization=True)
    (out / "generation_config.json").write_text(
        json.dumps({"bos_token_id": eos, "eos_token_id": eos, "do_sample": False}, indent=2)
    )
    summary = {
        "path": str(out),
        **asdict(spec),
        "hidden_size": spec.hidden_size,
        "vocab": vocab,
        "kv_bytes_per_token": spec.kv_bytes_per_token,
    }
    (out / "kvpush-model.json").write_text(json.dumps(summary, indent=2))
    return summary


def build_tiny_lora(base: Path, out: Path, rank: int = 8, seed: int = 7) -> Path:
    """A random LoRA adapter for the tiny model in `base` (Qwen2 or Llama), in PEFT's
    format, which vLLM's `--lora-modules NAME=DIR` loads: rank `rank` on every layer's
    q_proj and v_proj, large enough to change the answers."""
    import torch
    from safetensors.torch import save_file

    config = json.loads((base / "config.json").read_text())
    hidden, layers = config["hidden_size"], config["num_hidden_layers"]
    head_dim = config.get("head_dim") or hidden // config["num_attention_heads"]
    widths = {"q_proj": config["num_attention_heads"] * head_dim,
              "v_proj": config["num_key_value_heads"] * head_dim}  # fmt: skip
    generator = torch.Generator().manual_seed(seed)

    def weight(*shape: int) -> Any:
        return (torch.randn(*shape, generator=generator) * 0.5).to(torch.bfloat16)

    tensors = {}
    for layer in range(layers):
        for proj, width in widths.items():
            name = f"base_model.model.model.layers.{layer}.self_attn.{proj}"
            tensors[f"{name}.lora_A.weight"] = weight(rank, hidden)
            tensors[f"{name}.lora_B.weight"] = weight(width, rank)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    adapter = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": 2 * rank,
               "lora_dropout": 0.0, "target_modules": sorted(widths), "bias": "none",
               "base_model_name_or_path": str(base)}  # fmt: skip
    (out / "adapter_config.json").write_text(json.dumps(adapter, indent=2))
    return out


def ensure_tiny_model(out: Path, spec: TinyModelSpec) -> Path:
    """Build the model unless `out` already holds one with the same spec."""
    marker = out / "kvpush-model.json"
    if marker.exists():
        built = json.loads(marker.read_text())
        if all(built.get(k) == v for k, v in asdict(spec).items()):
            return out
    build_tiny_model(out, spec)
    return out
