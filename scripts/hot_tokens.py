"""Pick a draft vocabulary: the N most frequent token ids of some text under the target's tokenizer.

    python -m scripts.hot_tokens --target ckpt/qwen36 --size 32768 corpus/*.txt --out hot.json
    ddtree-generate --target ckpt/qwen36 --drafter ckpt/dflash --draft-vocab hot.json ...

Writes {"ids": [...], "size": N, "coverage": ...} atomically: the ids ascending, plus the share of
the counted tokens the ids cover (a draft can only be accepted when the target's next token is
among them, so coverage on text like the workload's bounds what the drafter can still hit).
Ids the text never shows fill the rest in id order (ddtree_jax/speculative/draft_vocab.py: `first_ids`).
Files are read as UTF-8 text; a .jsonl file contributes the "text" (or "prompt") field of each line.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys

from ddtree_jax import atomic
from ddtree_jax.engine import load_tokenizer


def texts(path: str):
    with open(path, encoding="utf-8", errors="replace") as f:
        if path.endswith(".jsonl"):
            for line in f:
                if line.strip():
                    row = json.loads(line)
                    yield row.get("text") or row.get("prompt") or ""
        else:
            yield f.read()


def hot_ids(counts: collections.Counter, size: int, vocab_size: int) -> list[int]:
    """The `size` most frequent ids (ties: smaller id first), topped up with unseen ids in id order."""
    ranked = sorted(counts, key=lambda i: (-counts[i], i))[:size]
    chosen = set(ranked)
    for i in range(vocab_size):
        if len(chosen) >= size:
            break
        chosen.add(i)
    return sorted(chosen)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("files", nargs="+", help="text (.txt, ...) or .jsonl files")
    ap.add_argument("--target", required=True, help="target checkpoint directory (its tokenizer.json)")
    ap.add_argument("--size", type=int, default=32768, help="ids to keep (default 32768)")
    ap.add_argument("--vocab-size", type=int, default=None,
                    help="the target's vocabulary size (default: the tokenizer's, with added tokens)")
    ap.add_argument("--out", required=True, help="JSON file for --draft-vocab")
    args = ap.parse_args(argv)
    tok = load_tokenizer(args.target)
    if tok is None:
        print(f"hot_tokens: {args.target} has no tokenizer.json", file=sys.stderr)
        return 2
    vocab_size = args.vocab_size or tok.get_vocab_size(with_added_tokens=True)
    if not 1 <= args.size <= vocab_size:
        print(f"hot_tokens: --size must be in [1, {vocab_size}], got {args.size}", file=sys.stderr)
        return 2
    counts = collections.Counter()
    for path in args.files:
        for text in texts(path):
            counts.update(i for i in tok.encode(text).ids if i < vocab_size)
    ids = hot_ids(counts, args.size, vocab_size)
    total = sum(counts.values())
    covered = sum(counts[i] for i in ids)
    report = {"ids": ids, "size": len(ids), "counted_tokens": total, "coverage": covered / total if total else None,
              "files": args.files, "target": args.target}
    atomic.write_json(args.out, report)
    print(f"hot_tokens: {len(ids)} ids cover {100 * (report['coverage'] or 0):.2f} % of {total} tokens; "
          f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
