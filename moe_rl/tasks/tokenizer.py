"""Tokenizers: the small protocol the rest of the toolkit codes against, and the character tokenizer of the tiny models.

`encode` never adds special tokens: the caller (rollout, SFT batching) places BOS and EOS itself, so a Hugging Face
tokenizer is adapted by calling it with `add_special_tokens=False`. `decode` reads a generated sequence: it stops at
the first EOS (excluded) and skips PAD and BOS, so a padded row decodes to exactly the completion text.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol, runtime_checkable


@runtime_checkable
class Tokenizer(Protocol):
    """What the trainer, the sampler and the tasks need from a tokenizer."""

    vocab_size: int
    pad_id: int
    bos_id: int
    eos_id: int

    def encode(self, text: str) -> list[int]:
        """Text -> token ids, without special tokens. Raises ValueError for text the vocabulary cannot hold."""
        ...

    def decode(self, ids: Iterable[int]) -> str:
        """Token ids -> text, stopping at the first EOS (excluded) and skipping PAD and BOS."""
        ...


# Fixed, task-independent vocabulary: a checkpoint trained on one task can be evaluated on another.
PAD_ID, BOS_ID, EOS_ID = 0, 1, 2
_SPECIALS = 3
_CHARS = [chr(c) for c in range(32, 127)] + ["\n"]  # printable ASCII, then newline


class CharTokenizer:
    """One token per character: ids 0..2 are PAD, BOS, EOS; 3..97 are ASCII 32..126; 98 is '\\n'. vocab_size = 99."""

    vocab_size = _SPECIALS + len(_CHARS)
    pad_id = PAD_ID
    bos_id = BOS_ID
    eos_id = EOS_ID

    def __init__(self) -> None:
        self._id_of = {ch: _SPECIALS + i for i, ch in enumerate(_CHARS)}

    def encode(self, text: str) -> list[int]:
        """Text -> one id per character. Raises ValueError naming the first character outside the vocabulary."""
        try:
            return [self._id_of[ch] for ch in text]
        except KeyError as err:
            ch = err.args[0]
            raise ValueError(
                f"character {ch!r} (U+{ord(ch):04X}) at position {text.index(ch)} is not in the character "
                "vocabulary (printable ASCII and newline)"
            ) from None

    def decode(self, ids: Iterable[int]) -> str:
        """Ids (ints or 0-d tensors) -> text up to the first EOS; PAD and BOS are skipped. Unknown ids raise."""
        chars = []
        for token in ids:
            token = int(token)
            if token == EOS_ID:
                break
            if token in (PAD_ID, BOS_ID):
                continue
            if not _SPECIALS <= token < self.vocab_size:
                raise ValueError(f"token id {token} is outside the vocabulary [0, {self.vocab_size})")
            chars.append(_CHARS[token - _SPECIALS])
        return "".join(chars)


class HFTokenizer:
    """A Hugging Face tokenizer behind the Tokenizer protocol (`tokenizer` is a transformers tokenizer object).

    Special ids: EOS is required; a tokenizer without BOS (Qwen's) starts prompts with EOS, as GPT-2 style models
    do; PAD falls back to UNK. PAD must differ from BOS and EOS, because batching tells padding apart by its id.
    """

    def __init__(self, tokenizer) -> None:
        self._tok = tokenizer
        self.vocab_size = len(tokenizer)
        if tokenizer.eos_token_id is None:
            raise ValueError(f"tokenizer {type(tokenizer).__name__} has no EOS token")
        self.eos_id = tokenizer.eos_token_id
        self.bos_id = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else self.eos_id
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.unk_token_id
        if pad is None or pad in (self.bos_id, self.eos_id):
            raise ValueError(f"tokenizer {type(tokenizer).__name__} needs a PAD (or UNK) token distinct from BOS "
                             f"and EOS; got pad={pad}, bos={self.bos_id}, eos={self.eos_id}")
        self.pad_id = pad

    @property
    def transformers_tokenizer(self):
        """The transformers tokenizer behind this one (what an exported model's folder gets)."""
        return self._tok

    def encode(self, text: str) -> list[int]:
        """Text -> ids without special tokens. Raises ValueError if the text needs the unknown token."""
        ids = self._tok.encode(text, add_special_tokens=False)
        unk = self._tok.unk_token_id
        if unk is not None and unk in ids and (self._tok.unk_token or "") not in text:
            raise ValueError(f"text {text[:40]!r} has characters the tokenizer maps to its unknown token")
        return ids

    def decode(self, ids: Iterable[int]) -> str:
        """Ids -> text up to the first EOS; PAD and BOS are skipped."""
        kept = []
        for token in ids:
            token = int(token)
            if token == self.eos_id:
                break
            if token not in (self.pad_id, self.bos_id):
                kept.append(token)
        return self._tok.decode(kept, clean_up_tokenization_spaces=False)


# The special tokens' names in a Hugging Face copy of the character tokenizer: characters the vocabulary cannot
# encode, so that no prompt text ever reads as one (an ASCII name such as "<s>" would, and would turn three
# characters into one id).
HF_SPECIAL_NAMES = ("⟨pad⟩", "⟨bos⟩", "⟨eos⟩")


def char_tokenizer_as_hf():
    """The character tokenizer as a transformers PreTrainedTokenizerFast (built with the `tokenizers` library), for
    an exported model: the same id for every character, one token per character, PAD/BOS/EOS = 0/1/2. Text outside
    the vocabulary raises, as CharTokenizer.encode does. `add_special_tokens` (the default of `tokenizer(text)`)
    prepends BOS, as moe-rl's sampler does to every prompt; `decode(..., skip_special_tokens=True)` gives the text."""
    from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
    from tokenizers import Tokenizer as RustTokenizer
    from transformers import PreTrainedTokenizerFast

    pad, bos, eos = HF_SPECIAL_NAMES
    vocab = {pad: PAD_ID, bos: BOS_ID, eos: EOS_ID, **{ch: _SPECIALS + i for i, ch in enumerate(_CHARS)}}
    tok = RustTokenizer(models.WordLevel(vocab, unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")  # every character alone
    tok.decoder = decoders.Fuse()  # join the characters without spaces
    tok.add_special_tokens([AddedToken(name, special=True) for name in HF_SPECIAL_NAMES])
    tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A $B",
                                                       special_tokens=[(bos, BOS_ID)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=pad, bos_token=bos, eos_token=eos)
