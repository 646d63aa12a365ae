"""Write second (or later) turns for conversations the target has already answered: more drafter data once
the first turns run out.

Each line of an answers file (`eaglewire regenerate` over first turns from
`sharegpt_first_turns.py`, or over its second turns for ``--turn 3``) is matched by
its first prompt to the ShareGPT conversation it came from. Where that conversation
goes on with a user turn of 20 to 1,500 characters and an answer, the line is
written again with that turn appended: the earlier answers are the target's own,
the last the original (a placeholder that regenerate replaces). MT-bench questions
have a second turn too, so these contexts are ones the drafter meets at serving time.

    python scripts/sharegpt_second_turns.py --first-turns first_turns.jsonl --out second_m.jsonl answers_m.jsonl
    eaglewire regenerate --data second_m.jsonl --keep-answers 1 --batch 32 --max-new-tokens 256 --max-len 1024 \\
        --out answers2_m.jsonl
    python scripts/sharegpt_second_turns.py --turn 3 --first-turns first_turns.jsonl --out third.jsonl answers2_*.jsonl
    eaglewire regenerate --data third.jsonl --keep-answers 2 ...
"""

from __future__ import annotations

import argparse
import json

from sharegpt_first_turns import MAX_CHARS, MIN_CHARS

from eaglewire.data.conversations import SHAREGPT, iter_records, open_source


def user_turn(messages: list[dict], turn: int) -> tuple[dict, dict] | None:
    """The ``turn``-th user turn (from 1) and the answer to it, or None when the conversation has none."""
    at = 2 * (turn - 1)
    if len(messages) < at + 2 or messages[at]["role"] != "user" or messages[at + 1]["role"] != "assistant":
        return None
    return messages[at], messages[at + 1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("answers", nargs="+", help="regenerated answers to the turns before --turn (.jsonl)")
    parser.add_argument("--turn", type=int, default=2, help="the user turn to append (default 2: the second)")
    parser.add_argument("--first-turns", required=True, help="the sharegpt_first_turns.py file the answers came from")
    parser.add_argument("--data", default=SHAREGPT, help="the conversations the first turns came from")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    if args.turn < 2:
        raise SystemExit(f"--turn must be >= 2 (first turns come from sharegpt_first_turns.py), got {args.turn}")
    with open(args.first_turns) as handle:  # first turns are unique prompts (the script drops duplicates)
        source_of = {(row := json.loads(line))["messages"][0]["content"]: row["source_index"] for line in handle}
    answered = []
    for path in args.answers:
        with open(path) as handle:
            answered += [json.loads(line)["messages"] for line in handle]
    unknown = [m[0]["content"][:60] for m in answered if m[0]["content"] not in source_of]
    if unknown:
        raise SystemExit(f"{len(unknown)} answered prompts are not in {args.first_turns}, e.g. {unknown[0]!r}: "
                         "pass the first-turns file these answers were regenerated from")
    wanted = {source_of[m[0]["content"]] for m in answered}
    follow_up = {}
    for record in iter_records(open_source(args.data)):
        if record.index in wanted and record.messages:
            turn = user_turn(record.messages, args.turn)
            if turn is not None and MIN_CHARS <= len(turn[0]["content"].strip()) <= MAX_CHARS:
                follow_up[record.index] = turn
    kept = 0
    with open(args.out, "w") as out:
        for messages in answered:
            turn = follow_up.get(source_of[messages[0]["content"]])
            if turn is None or len(messages) != 2 * (args.turn - 1):  # a conversation regenerate cut short
                continue
            user = {"role": "user", "content": turn[0]["content"].strip()}
            out.write(json.dumps({"messages": [*messages, user, turn[1]]}, ensure_ascii=False) + "\n")
            kept += 1
    print(f"{kept} of {len(answered)} answered conversations go on with user turn {args.turn} -> {args.out}")


if __name__ == "__main__":
    main()
