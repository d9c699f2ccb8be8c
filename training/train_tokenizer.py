"""Train a byte-level BPE tokenizer (HuggingFace ``tokenizers``) on a corpus.

    python -m mixerlab.training.train_tokenizer --corpus <parquet/jsonl file, dir or glob> --vocab_size 32768 \\
        --out tokenizer.json [--text_column text] [--min_frequency 2] [--max_docs N]

The tokenizer is the embedded corpus's recipe (data/embedded/README.md): ByteLevel pre-tokenizer without a
prefix space, ByteLevel decoder, the full 256-byte initial alphabet (every UTF-8 string encodes, no unknown
token) and one special token ``<|endoftext|>`` at id 0, which ``training.tokenizer.HFTokenizer`` takes as EOS.
The corpus is read with ``training.prepare_data.iter_documents`` (local or bucket paths); for a FineWeb-Edu
scale corpus, ``--max_docs`` trains on a prefix (a few hundred thousand documents are plenty for 32k merges).
"""
from __future__ import annotations

import argparse
import sys
from typing import Sequence

from mixerlab.training.cli_errors import entry_point
from mixerlab.training.prepare_data import PrepareError, epath, iter_documents
from mixerlab.training.tokenizer import HF_EOS_CANDIDATES

EOS_TOKEN = HF_EOS_CANDIDATES[0]  # "<|endoftext|>": the first end-of-text token the project's loader looks for
MIN_VOCAB = 257  # 256 byte symbols + EOS


def build_trainer(vocab_size: int, min_frequency: int, show_progress: bool):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency, special_tokens=[EOS_TOKEN],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=show_progress)
    return tok, trainer


def train(corpus: str, vocab_size: int, out: str, *, text_column: str = "text", min_frequency: int = 2,
          max_docs: int | None = None, show_progress: bool = True) -> dict:
    """Trains and writes ``out``; returns {"vocab_size", "docs", "eos_id"}."""
    from tqdm import tqdm

    docs, total = iter_documents(corpus, text_column, "--corpus")
    if max_docs is not None:
        total = min(total, max_docs) if total is not None else max_docs
    tok, trainer = build_trainer(vocab_size, min_frequency, show_progress)
    bar = tqdm(total=total, unit="doc", desc="reading corpus", disable=not show_progress, file=sys.stderr)
    count = 0

    def texts():
        nonlocal count
        for text, _ in docs:
            if max_docs is not None and count >= max_docs:
                return
            count += 1
            bar.update(1)
            if text:
                yield text

    tok.train_from_iterator(texts(), trainer=trainer, length=total)
    bar.close()
    if count == 0:
        raise PrepareError(f"--corpus: {corpus!r} holds no documents")
    path = epath(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(tok.to_str())
    return {"vocab_size": tok.get_vocab_size(with_added_tokens=True), "docs": count,
            "eos_id": tok.token_to_id(EOS_TOKEN)}


@entry_point("mixerlab-train-tokenizer")
def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m training.train_tokenizer", description=__doc__.split("\n\n")[0])
    ap.add_argument("--corpus", required=True, help="Parquet/JSONL file, directory or glob (local or bucket)")
    ap.add_argument("--vocab_size", type=int, required=True, help=f"target vocabulary, >= {MIN_VOCAB}")
    ap.add_argument("--out", required=True, help="where to write tokenizer.json")
    ap.add_argument("--text_column", default="text")
    ap.add_argument("--min_frequency", type=int, default=2, help="a merge needs a pair seen this often")
    ap.add_argument("--max_docs", type=int, default=None, help="train on the first N documents only")
    ap.add_argument("--no_progress", action="store_true")
    args = ap.parse_args(argv)
    if args.vocab_size < MIN_VOCAB:
        ap.error(f"--vocab_size: must be >= {MIN_VOCAB} (256 bytes + {EOS_TOKEN}), got {args.vocab_size}")
    if args.min_frequency < 1:
        ap.error(f"--min_frequency: must be >= 1, got {args.min_frequency}")
    if args.max_docs is not None and args.max_docs < 1:
        ap.error(f"--max_docs: must be >= 1, got {args.max_docs}")
    try:
        info = train(args.corpus, args.vocab_size, args.out, text_column=args.text_column,
                     min_frequency=args.min_frequency, max_docs=args.max_docs, show_progress=not args.no_progress)
    except PrepareError as e:
        print(f"training.train_tokenizer: {e}", file=sys.stderr)
        return 2
    print(f"wrote {args.out}: vocabulary {info['vocab_size']} ({EOS_TOKEN} = id {info['eos_id']}), trained on "
          f"{info['docs']} documents")
    return 0


if __name__ == "__main__":
    sys.exit(main())
