"""The demo's text: a public-domain book shipped in the package, a character-level tokenizer
built from it (nothing to download), and random training windows."""

from __future__ import annotations

from importlib import resources

import torch

CORPUS = "alice.txt"  # Alice's Adventures in Wonderland; see corpus/README.md
SPECIAL_TOKENS = ("<pad>", "<unk>", "<s>", "</s>")


def corpus_text(name: str = CORPUS) -> str:
    return resources.files(__package__).joinpath("corpus", name).read_text(encoding="utf-8")


def char_tokenizer(text: str):
    """A transformers tokenizer with one token per character of `text` (plus <pad>, <unk>, <s>,
    </s>), built with the `tokenizers` library: `tok(prompt, return_tensors="pt")` and
    `tok.decode(ids)` work as with any Hugging Face tokenizer."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate([*SPECIAL_TOKENS, *sorted(set(text))])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")  # every character
    tok.decoder = decoders.Fuse()  # characters join without separators
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>", bos_token="<s>",
                                   eos_token="</s>")  # fmt: skip


def encode_corpus(tokenizer, text: str) -> torch.Tensor:
    return torch.tensor(tokenizer(text, add_special_tokens=False).input_ids, dtype=torch.long)


class Windows:
    """Random windows of `seq_len` tokens from `ids`, `batch_size` at a time, from a seeded
    generator: the same seed gives the same batches on every device."""

    def __init__(self, ids: torch.Tensor, batch_size: int, seq_len: int, seed: int):
        if ids.numel() <= seq_len:
            raise ValueError(f"the corpus has {ids.numel()} tokens: too few for windows of {seq_len}")
        self.ids, self.batch_size, self.seq_len = ids, batch_size, seq_len
        self.generator = torch.Generator().manual_seed(seed)

    def next(self) -> torch.Tensor:
        starts = torch.randint(0, self.ids.numel() - self.seq_len, (self.batch_size,), generator=self.generator)
        return torch.stack([self.ids[s : s + self.seq_len] for s in starts.tolist()])
