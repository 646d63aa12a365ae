"""Does `eaglewire doctor --server` name the miswiring a server really runs?

For the declared wiring and six deliberate miswirings of a drafter (by default the shipped one), this
writes a copy of the checkpoint that declares the miswiring, so `eaglewire serve` captures those tensors
and feeds them to the unchanged weights: the fault of an engine that reads the wrong layer ids. It serves
each copy, runs `eaglewire doctor ORIGINAL --server URL --json` (the doctor sends its live prompts and
reads the accept length /metrics counts over them), and records the verdict of acceptance.observed and
the wirings whose walk over the live continuations reproduces the served figure: a fault is named when
the check fails and the served wiring is among them. Prints a table and writes
benchmarks/results/doctor_served.json.

    python benchmarks/doctor_served.py [--drafter shipped] [--live-prompts 6] [--live-tokens 64]
        [--serve-option=--lookup-min=3 ...] [--out FILE]

``--serve-option`` passes an option to every server (e.g. lookups, which the doctor reads from the server's
metrics and walks).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
import time
from dataclasses import replace
from pathlib import Path

from eaglewire.drafter.checkpoint import load_checkpoint, save_checkpoint
from eaglewire.drafter.shipped import shipped_drafter
from eaglewire.serve.launch import EAGLEWIRE, launch
from eaglewire.target import DEFAULT_TARGET, load_target
from eaglewire.wiring import Wiring

RESULTS = Path(__file__).parent / "results" / "doctor_served.json"


def cases(declared: Wiring) -> list[tuple[str, Wiring]]:
    """The declared wiring (the control) and faults an engine that reads wrong layer ids makes: every id off
    by one either way, one id off by one, and the embedding captured for one id. An engine concatenates what
    it captures in stream order, so these are the miswirings a server can run."""
    aux = [str(p) for p in declared.aux]

    def shifted(point: str, by: int) -> str:
        return f"layer{int(point[5:].split('.')[0]) + by}.out"

    def stream_order(points: list[str]) -> Wiring:
        return Wiring(tuple(sorted(Wiring.parse(",".join(points)).aux)))

    return [("declared", declared),
            ("every id shifted +1", stream_order([shifted(p, 1) for p in aux])),
            ("every id shifted -1", stream_order([shifted(p, -1) for p in aux])),
            (f"aux[1] {aux[1]} -> {shifted(aux[1], 1)}", stream_order([aux[0], shifted(aux[1], 1), aux[2]])),
            (f"embed for aux[0] {aux[0]}", stream_order(["embed", aux[1], aux[2]])),
            (f"embed for aux[1] {aux[1]}", stream_order([aux[0], "embed", aux[2]])),
            (f"embed for aux[2] {aux[2]}", stream_order([aux[0], aux[1], "embed"]))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--drafter", default="shipped", help="checkpoint folder, or 'shipped'")
    parser.add_argument("--live-prompts", type=int, default=6)
    parser.add_argument("--live-tokens", type=int, default=64)
    parser.add_argument("--threads", default="1", help="OMP_NUM_THREADS of the server and the doctor")
    parser.add_argument("--serve-option", action="append", default=[], metavar="OPTION",
                        help="an option for every `eaglewire serve`, e.g. --serve-option=--lookup-min=3 (repeatable)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    original = shipped_drafter(DEFAULT_TARGET) if args.drafter == "shipped" else Path(args.drafter)
    target = load_target(DEFAULT_TARGET)
    checkpoint = load_checkpoint(original, target.layout.embed)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, wiring in cases(checkpoint.meta.wiring):
            served = save_checkpoint(Path(tmp) / name.replace(" ", "_"), checkpoint.drafter,
                                     replace(checkpoint.meta, wiring=wiring))
            server = launch(["--drafter", str(served), "--log-interval", "600", *args.serve_option],
                            threads=int(args.threads),
                            timeout_s=300)
            try:
                start = time.perf_counter()
                doctor = subprocess.run([EAGLEWIRE, "doctor", str(original), "--server", server.url, "--json",
                                         "--live-prompts", str(args.live_prompts), "--live-tokens", str(args.live_tokens)],
                                        capture_output=True, text=True, check=False,
                                        env={**os.environ, "OMP_NUM_THREADS": args.threads})
                seconds = time.perf_counter() - start
            finally:
                server.stop()
            if doctor.returncode not in (0, 1):
                raise SystemExit(f"the doctor failed on {name}:\n{doctor.stderr[-2000:]}")
            report = json.loads(doctor.stdout)
            observed = next(r for r in report["results"] if r["name"] == "acceptance.observed")
            ranked = observed["data"]["rows"]
            truth = str(wiring)
            true_row = next(r for r in ranked if r["wiring"] == truth)
            reproduced = observed["data"].get("reproduced_by")  # absent when the answers were not the live ones
            declared = str(checkpoint.meta.wiring)
            row = {"served": name, "served_wiring": truth, "observed_accept_len": observed["data"]["observed_accept_len"],
                   "verdict": observed["status"], "reproduced_by": reproduced,
                   "reproduced_within": observed["data"].get("reproduced_within"),
                   "true_reproduces": reproduced is not None and truth in reproduced,
                   "declared_reproduces": reproduced is not None and declared in reproduced,
                   "true_predicted": true_row["predicted_accept_len"], "ranked_first": ranked[0]["wiring"],
                   "true_rank": 1 + [r["wiring"] for r in ranked].index(truth), "doctor_s": seconds,
                   # with lookups: the steps the true wiring's walk drafted from the context, and the server's count
                   "lookup_steps_walked": true_row.get("lookup_steps"),
                   "lookup_steps_served": observed["data"].get("observed_lookup_steps"),
                   "detail": observed["detail"], "fix": observed["fix"]}
            rows.append(row)
            alike = len(reproduced or []) - row["true_reproduces"]
            print(f"{name:36s} observed {row['observed_accept_len']:.3f}  true predicts {row['true_predicted']:.3f}  "
                  f"{row['verdict']:4s}  reproduced by the true wiring: {row['true_reproduces']}, by the declared: "
                  f"{row['declared_reproduces']}, by {alike} other(s)  {seconds:.0f} s", flush=True)
    faults = [r for r in rows if r["served"] != "declared"]
    named = sum(r["verdict"] == "fail" and r["true_reproduces"] for r in faults)
    alike = [r["served"] for r in faults if r["declared_reproduces"]]
    control = rows[0]
    print(f"miswirings failed and named (the true wiring reproduces the figure, the declared one does not): {named} of "
          f"{len(faults)}; served like the declared wiring (acceptance cannot tell): {', '.join(alike) or 'none'}; the "
          f"declared control {'passes' if control['verdict'] == 'pass' else 'FAILS'}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    settings = {**vars(args), "out": str(args.out), "drafter": str(original)}
    args.out.write_text(json.dumps({"settings": settings, "rows": rows, "named": named, "faults": len(faults),
                                    "indistinguishable": alike}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
