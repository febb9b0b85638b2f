"""Small random-weight Llama-style models, made locally (no downloads).

Used by the end-to-end tests, the README's first command and
``benches/ttft.py``. The tokenizer is a byte-level BPE trained on a fixed
synthetic corpus, so the same arguments always give the same model::

    python -m ucm.vllm_demo.tiny_model DIR [--layers 2 --hidden 128 ...]

The CPU attention backend of vLLM needs ``head_dim`` in {32, 64, 80, 96, 112,
128, ...}; ``hidden / heads`` is the head size here.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import random
from dataclasses import asdict, dataclass
from pathlib import Path

_SPECIALS = ["<unk>", "<s>", "</s>", "<pad>"]
_WORDS = (
    "the cache of keys and values is stored on disk so that a later request with the same "
    "prefix loads it instead of computing it again every block has an id made from its "
    "tokens and the id of the block before it a store keeps blocks in files a scheduler "
    "asks how many blocks of a prompt are present and the workers load them layer by layer "
    "while attention runs on the previous layer time to first token drops when prefill is "
    "skipped python rust vllm model engine request prompt token block layer shard store"
).split()


@dataclass(frozen=True)
class TinyModelSpec:
    """Shape of the model. The defaults make a 1.3 M-parameter model."""

    layers: int = 2
    hidden: int = 128
    heads: int = 4
    kv_heads: int = 2
    intermediate: int = 256
    vocab: int = 512
    max_positions: int = 16384
    seed: int = 0

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


def _corpus(seed: int) -> list[str]:
    rng = random.Random(seed)
    lines = []
    for _ in range(2000):
        n = rng.randint(4, 16)
        lines.append(" ".join(rng.choice(_WORDS) for _ in range(n)))
    return lines


def _make_tokenizer(spec: TinyModelSpec, out: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=spec.vocab,
        special_tokens=_SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(spec.seed), trainer=trainer)
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
    )
    fast.chat_template = (
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant: {% endif %}"
    )
    fast.save_pretrained(str(out))


def make_tiny_llama(out: str | Path, spec: TinyModelSpec | None = None) -> Path:
    """Writes a random-weight Llama (float32 safetensors) and its tokenizer to ``out``.

    Reuses ``out`` when it already holds a model made from the same spec.
    """
    spec = spec or TinyModelSpec()
    out = Path(out)
    stamp = out / "ucm_tiny_model.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    # Processes making the same model at once (parallel test workers) take
    # turns: one writes it, the others find its stamp. Without the lock one
    # could rewrite the files while another's engine reads them.
    with open(out.parent / f".{out.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if stamp.exists() and json.loads(stamp.read_text()) == asdict(spec):
            return out
        _write_tiny_llama(spec, out, stamp)
    return out


def _write_tiny_llama(spec: TinyModelSpec, out: Path, stamp: Path) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    out.mkdir(parents=True, exist_ok=True)
    _make_tokenizer(spec, out)
    cfg = LlamaConfig(
        vocab_size=spec.vocab,
        hidden_size=spec.hidden,
        intermediate_size=spec.intermediate,
        num_hidden_layers=spec.layers,
        num_attention_heads=spec.heads,
        num_key_value_heads=spec.kv_heads,
        head_dim=spec.head_dim,
        max_position_embeddings=spec.max_positions,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=3,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    torch.manual_seed(spec.seed)
    model = LlamaForCausalLM(cfg).to(torch.float32)
    # Larger-than-default weights keep greedy decoding away from ties, so
    # token comparisons between runs are meaningful.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.06)
    model.save_pretrained(str(out), safe_serialization=True)
    stamp.write_text(json.dumps(asdict(spec)))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    d = TinyModelSpec()
    options = ("layers", "hidden", "heads", "kv_heads", "intermediate", "vocab", "seed")
    for name in options:
        ap.add_argument(f"--{name.replace('_', '-')}", type=int, default=getattr(d, name))
    args = ap.parse_args(argv)
    spec = TinyModelSpec(**{name: getattr(args, name) for name in options})
    print(make_tiny_llama(args.out, spec))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
