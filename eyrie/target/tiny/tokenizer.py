"""A byte-level BPE tokenizer trained on the bundled demo data, with a ChatML chat template."""

from __future__ import annotations

from pathlib import Path

CHATML_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def build_tokenizer(
    path: Path,
    vocab_size: int = 512,
    extra_special_tokens: list[str] | None = None,
    chat_template: str | None = CHATML_TEMPLATE,
):
    """Train and save the tokenizer into `path`; returns the transformers tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from eyrie.target.tiny.demo_data import conversations, corpus_text

    specials = SPECIAL_TOKENS + list(extra_special_tokens or [])
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(corpus_text(conversations()), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=None, eos_token="<|im_end|>", pad_token="<|endoftext|>", unk_token=None
    )
    if chat_template is not None:
        fast.chat_template = chat_template
    fast.save_pretrained(str(path))
    return fast
