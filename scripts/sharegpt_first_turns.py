"""Write the ShareGPT first turns that the regenerated drafter data answers (ledger rows 5-7).

Keeps each conversation's first user turn when it is 20 to 1,500 characters long
(prompts shaped like MT-bench questions: long pasted documents and one-word
openers are left out) and has not been seen before (exact duplicates are common
in ShareGPT). Each line keeps the original answer so that the record is a valid
conversation; `eaglewire regenerate` replaces it with the target's own.

    python scripts/sharegpt_first_turns.py --out data/first_turns.jsonl
    sed -n '1501,3000p' data/first_turns.jsonl > data/turns_b.jsonl     # a slice a drafter has not seen
    eaglewire regenerate --data data/turns_b.jsonl --batch 32 --max-new-tokens 256 --max-len 1024 --out data/answers_b.jsonl
"""

from __future__ import annotations

import argparse
import json

from eaglewire.data.conversations import SHAREGPT, iter_records, open_source

MIN_CHARS, MAX_CHARS = 20, 1500


def first_turn(messages: list[dict]) -> tuple[dict, dict] | None:
    """The first user turn and the answer to it, or None when the conversation does not start with a user turn."""
    if len(messages) < 2 or messages[0]["role"] != "user" or messages[1]["role"] != "assistant":
        return None
    return messages[0], messages[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", default=SHAREGPT, help="conversations to take first turns from (default: ShareGPT)")
    parser.add_argument("--out", required=True)
    parser.add_argument("--limit", type=int, default=None, help="stop after this many first turns")
    args = parser.parse_args()
    seen, kept = set(), 0
    with open(args.out, "w") as out:
        for record in iter_records(open_source(args.data)):
            turn = first_turn(record.messages) if record.messages else None
            if turn is None:
                continue
            prompt = turn[0]["content"].strip()
            if not MIN_CHARS <= len(prompt) <= MAX_CHARS or prompt in seen:
                continue
            seen.add(prompt)
            line = {"messages": [{"role": "user", "content": prompt}, turn[1]], "source_index": record.index}
            out.write(json.dumps(line, ensure_ascii=False) + "\n")
            kept += 1
            if args.limit is not None and kept >= args.limit:
                break
    print(f"{kept} first turns -> {args.out}")


if __name__ == "__main__":
    main()
