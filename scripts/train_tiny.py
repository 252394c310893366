"""Train the two bundled models, ``tiny-py`` (dense) and ``tiny-py-moe`` (mixture of experts).

The corpus is the Python standard library's own source, which every Python install carries, so the
course has real text to generate without downloading anything. The run is seeded and sized for two
CPU cores; it writes, per model, an HF-format folder (config, bf16 safetensors, tokenizer files,
generation config), a model card with the held-out loss and perplexity, and a loss-curve PNG.

    python scripts/train_tiny.py --model tiny-py
    python scripts/train_tiny.py --model tiny-py-moe
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import platform
import sysconfig
import time
from pathlib import Path

import torch
from tqdm import tqdm

ROOT = Path(__file__).resolve().parents[1]
MODELS_DIR = ROOT / "assets" / "models"
TOKENIZER_DIR = MODELS_DIR / "_tokenizer"
EOS = "<|endoftext|>"
VOCAB_SIZE = 4096
HELD_OUT_PERCENT = 5  # by a hash of each file's path, so the split never depends on file order

# Architectures: Llama for the dense model (RoPE, RMSNorm, SwiGLU, grouped-query attention) and
# Mixtral for the MoE one (the same blocks with 8 SwiGLU experts, top-2, load-balancing loss).
DENSE = dict(
    hidden_size=256, intermediate_size=704, num_hidden_layers=6, num_attention_heads=8,
    num_key_value_heads=2, max_position_embeddings=1024, rms_norm_eps=1e-5, rope_theta=10000.0,
    tie_word_embeddings=True,
)
MOE = dict(
    hidden_size=256, intermediate_size=384, num_hidden_layers=4, num_attention_heads=8,
    num_key_value_heads=2, max_position_embeddings=1024, rms_norm_eps=1e-5, rope_theta=10000.0,
    tie_word_embeddings=True, num_local_experts=8, num_experts_per_tok=2,
    router_aux_loss_coef=0.02, output_router_logits=True,
)
SETTINGS = {
    "tiny-py": dict(arch=DENSE, steps=1900, batch=16, seq=256, lr=5e-3),
    "tiny-py-moe": dict(arch=MOE, steps=1500, batch=16, seq=256, lr=5e-3),
}



#: A chat template for a model of Python text: each message as a comment line, then the reply's cue.
CHAT_TEMPLATE = ("{%- for message in messages -%}\n"
                 "# {{ message['role'] }}: {{ message['content'] | replace('\\n', '\\n# ') }}\n"
                 "{% endfor -%}\n"
                 "{%- if add_generation_prompt -%}\n"
                 "# assistant:\n"
                 "{% endif -%}")

def stdlib_files() -> tuple[Path, list[Path]]:
    """The standard library's .py files, tests and third-party packages left out, in a fixed order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    # Tests, third-party code, and the two places that are data more than code: the codec tables
    # of encodings/ and the documentation strings of pydoc_data/.
    skip = {"site-packages", "test", "tests", "idle_test", "__pycache__", "encodings", "pydoc_data"}
    files = [p for p in root.rglob("*.py") if not skip & set(p.relative_to(root).parts)]
    return root, sorted(files, key=lambda p: p.relative_to(root).as_posix())


def is_held_out(relative: str) -> bool:
    return int(hashlib.sha256(relative.encode()).hexdigest(), 16) % 100 < HELD_OUT_PERCENT


def read_corpus() -> tuple[list[str], list[str], list[str]]:
    root, files = stdlib_files()
    train, held, held_names = [], [], []
    for path in files:
        text = path.read_text(encoding="utf-8", errors="replace")
        rel = path.relative_to(root).as_posix()
        if is_held_out(rel):
            held.append(text)
            held_names.append(rel)
        else:
            train.append(text)
    return train, held, held_names


def train_tokenizer(texts: list[str]):
    """Byte-level BPE over the training files, saved once and shared by both models.

    Pieces are whole lines rather than words, so merges may cross spaces: "def " and "import "
    become tokens of their own, and a prompt ending in that space looks like the training text.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    if (TOKENIZER_DIR / "tokenizer.json").exists():
        return PreTrainedTokenizerFast.from_pretrained(TOKENIZER_DIR)
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(r"\n"), behavior="merged_with_previous"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, min_frequency=2, special_tokens=[EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    bpe.train_from_iterator(texts, trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token=EOS, bos_token=EOS, unk_token=EOS,
                                  pad_token=EOS, clean_up_tokenization_spaces=False)
    tok.save_pretrained(TOKENIZER_DIR)
    return tok


def encode(tok, texts: list[str]) -> torch.Tensor:
    ids: list[int] = []
    for chunk in tok(texts, add_special_tokens=False)["input_ids"]:
        ids.extend(chunk)
        ids.append(tok.eos_token_id)
    return torch.tensor(ids, dtype=torch.long)


def build_model(name: str, tok):
    from transformers import LlamaConfig, LlamaForCausalLM, MixtralConfig, MixtralForCausalLM

    arch = SETTINGS[name]["arch"]
    common = dict(vocab_size=len(tok), bos_token_id=tok.eos_token_id, eos_token_id=tok.eos_token_id,
                  pad_token_id=tok.eos_token_id)
    if name == "tiny-py":
        return LlamaForCausalLM(LlamaConfig(**arch, **common))
    return MixtralForCausalLM(MixtralConfig(**arch, **common))


@torch.no_grad()
def held_out_loss(model, data: torch.Tensor, seq: int, max_windows: int = 64) -> float:
    model.eval()
    n = min(max_windows, (len(data) - 1) // seq)
    losses = []
    for i in range(n):
        x = data[i * seq:(i + 1) * seq][None]
        # HF shifts the labels itself, so the window is its own label; no router loss in the eval.
        out = model(input_ids=x, labels=x, output_router_logits=False)
        losses.append(out.loss.item())
    model.train()
    return sum(losses) / len(losses)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(SETTINGS), required=True)
    parser.add_argument("--steps", type=int, help="override the number of optimizer steps")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (default 1: run both models side by side on two cores)")
    parser.add_argument("--out-dir", type=Path, default=MODELS_DIR,
                        help="where the model folder goes (default assets/models; use another for trial runs)")
    args = parser.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    cfg = dict(SETTINGS[args.model])
    if args.steps:
        cfg["steps"] = args.steps

    train_texts, held_texts, held_names = read_corpus()
    tok = train_tokenizer(train_texts)
    train_ids, held_ids = encode(tok, train_texts), encode(tok, held_texts)
    print(f"corpus: {len(train_texts)} train files ({len(train_ids):,} tokens), "
          f"{len(held_texts)} held-out files ({len(held_ids):,} tokens)")

    model = build_model(args.model, tok)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"{args.model}: {n_params / 1e6:.2f}M parameters")
    opt = torch.optim.AdamW(model.parameters(), lr=cfg["lr"], betas=(0.9, 0.95), weight_decay=0.1)
    warmup = max(1, cfg["steps"] // 20)

    def lr_at(step: int) -> float:
        if step < warmup:
            return cfg["lr"] * (step + 1) / warmup
        progress = (step - warmup) / max(1, cfg["steps"] - warmup)
        return cfg["lr"] * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))

    gen = torch.Generator().manual_seed(1234)
    seq, batch = cfg["seq"], cfg["batch"]
    history: dict[str, list] = {"step": [], "train_loss": [], "eval_step": [], "eval_loss": []}
    start = time.time()
    model.train()
    bar = tqdm(range(cfg["steps"]), desc=f"training {args.model}")
    for step in bar:
        starts = torch.randint(0, len(train_ids) - seq, (batch,), generator=gen)
        x = torch.stack([train_ids[s:s + seq] for s in starts.tolist()])
        for group in opt.param_groups:
            group["lr"] = lr_at(step)
        # bf16 matmuls (fp32 master weights and optimizer): several times faster on CPUs with bf16 units.
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(input_ids=x, labels=x)
        # The MoE model's loss already includes router_aux_loss_coef * load-balancing loss.
        opt.zero_grad(set_to_none=True)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        history["step"].append(step)
        history["train_loss"].append(out.loss.item())
        bar.set_postfix(loss=f"{out.loss.item():.3f}")
        if (step + 1) % 100 == 0 or step + 1 == cfg["steps"]:
            history["eval_step"].append(step + 1)
            history["eval_loss"].append(held_out_loss(model, held_ids, seq))
    minutes = (time.time() - start) / 60
    final_eval = history["eval_loss"][-1]

    out_dir = args.out_dir / args.model
    out_dir.mkdir(parents=True, exist_ok=True)
    model.config.use_cache = True
    if hasattr(model.config, "output_router_logits"):
        model.config.output_router_logits = False
    model.to(torch.bfloat16).save_pretrained(out_dir)
    (out_dir / "model.safetensors").chmod(0o644)
    tok.save_pretrained(out_dir)
    # The class name transformers 4.x and 5.x both resolve, so the folder loads on either.
    tok_cfg_path = out_dir / "tokenizer_config.json"
    tok_cfg = json.loads(tok_cfg_path.read_text())
    tok_cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    tok_cfg["model_max_length"] = model.config.max_position_embeddings
    tok_cfg["chat_template"] = CHAT_TEMPLATE
    tok_cfg_path.write_text(json.dumps(tok_cfg, indent=2) + "\n")
    model.generation_config.do_sample = False
    model.generation_config.max_new_tokens = 64
    model.generation_config.save_pretrained(out_dir)
    (out_dir / "training_log.json").write_text(json.dumps(history))
    plot_loss(history, out_dir / "loss_curve.png", args.model)
    write_card(out_dir, args.model, n_params, cfg, len(train_texts), len(train_ids), held_names,
               len(held_ids), final_eval, minutes, tok, model)
    print(f"held-out loss {final_eval:.3f} (perplexity {math.exp(final_eval):.1f}) "
          f"after {minutes:.1f} min -> {out_dir}")


def plot_loss(history: dict, path: Path, name: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(history["step"], history["train_loss"], lw=0.8, alpha=0.6, label="train (per batch)")
    ax.plot(history["eval_step"], history["eval_loss"], "o-", label="held-out files")
    ax.set(xlabel="optimizer step", ylabel="cross-entropy (nats/token)", title=f"{name} training")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_card(out_dir, name, n_params, cfg, n_train_files, n_train_tokens, held_names,
               n_held_tokens, eval_loss, minutes, tok, model) -> None:
    model = model.float().eval()
    samples = []
    for prompt in ("def ", "import "):
        ids = tok(prompt, return_tensors="pt", add_special_tokens=False)["input_ids"]
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=40, do_sample=False, pad_token_id=tok.eos_token_id)
        samples.append(tok.decode(out[0]))
    arch = "Llama (dense)" if name == "tiny-py" else "Mixtral (8 experts, top-2)"
    corpus = (f"the Python {platform.python_version()} standard library's `.py` files (tests, site-packages, "
              "the codec tables of `encodings/` and `pydoc_data/` left out)")
    sample_text = "\n\n".join(f"```python\n{s}\n```" for s in samples)
    card = f"""# {name}

A tiny {arch} decoder trained from scratch by `scripts/train_tiny.py` for the minipd course. It
writes Python-looking text; it is a teaching model, not a useful code model.

| | |
| --- | --- |
| parameters | {n_params / 1e6:.2f}M |
| architecture | {json.dumps(SETTINGS[name]['arch'])} |
| tokenizer | byte-level BPE, {len(tok)} tokens, trained on the same training files |
| corpus | {corpus} |
| training files / tokens | {n_train_files} / {n_train_tokens:,} |
| held-out files / tokens | {len(held_names)} / {n_held_tokens:,} ({HELD_OUT_PERCENT}% of files, chosen by path hash) |
| steps x batch x sequence | {cfg['steps']} x {cfg['batch']} x {cfg['seq']} (AdamW, peak lr {cfg['lr']}, cosine) |
| held-out loss | {eval_loss:.3f} nats/token (perplexity {math.exp(eval_loss):.1f}) |
| training time | {minutes:.1f} min with {torch.get_num_threads()} CPU thread(s), bf16 autocast, seed 0 |
| weights | bfloat16 safetensors |

![loss curve](loss_curve.png)

Greedy continuations:

{sample_text}
"""
    (out_dir / "README.md").write_text(card)


if __name__ == "__main__":
    main()
