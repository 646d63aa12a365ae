"""This checkout's build of the rowwise kernel against another build of it: the same bits, and which is faster?

``--against avx2`` (where torch reports AVX-512): the same sources built with the AVX2 flags alone. This CPU's
build compiles them with AVX-512VL, whose 32 vector registers let x rows 5-8 multiply from weights decoded in
registers instead of a decoded panel (``rowwise_linear.cpp``, ``kRegisterRows``) and decode one row's 4-bit codes
by table lookup (``decode_block_by_table``).
``--against REV``: the kernel's sources as they were at git revision REV, built with this CPU's flags: what a
change to the kernel bought.

Both builds must give the same bits for every layer matrix and row count; then the target's layer matrices
(one thread, every matrix once, as a forward reads them) are timed for each row count with both builds in
alternating order, and medians reported. ``--end-to-end N`` also decodes the first N MT-bench questions with the
shipped drafter, plainly and with the default chain, under each build in rotating order (the engine's kernel
swapped between runs), checks that every output is the same, and reports the median per-question time ratios.

    OMP_NUM_THREADS=1 python benchmarks/kernel_builds.py --rounds 9 --out benchmarks/results/register_rows_zen4.json
    OMP_NUM_THREADS=1 python benchmarks/kernel_builds.py --against 841c580 --rounds 11 \
        --out benchmarks/results/kernel_unrolled_zen4.json
    OMP_NUM_THREADS=1 python benchmarks/kernel_builds.py --against 841c580 --rounds 5 --end-to-end 12 \
        --out benchmarks/results/kernel_unrolled_zen4_end_to_end.json

Run as a script: ``codes_bound`` (the layer matrices it times) is imported from this folder.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from unittest import mock

import torch
from codes_bound import layer_projections
from torch.utils.cpp_extension import load

from eaglewire.bench.prompts import load_prompts
from eaglewire.engine import rowwise_kernel
from eaglewire.engine.lean import LeanModel
from eaglewire.engine.projection import cpu_features
from eaglewire.engine.speculative import Engine, GenerationConfig
from eaglewire.target import load_target


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="smollm2-135m")
    parser.add_argument("--against", default="avx2",
                        help="avx2 (the same sources, AVX2 flags alone) or a git revision (its kernel sources)")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--rows", default="1,2,3,4,5,6,7,8", help="x rows per product (1 = a decode step)")
    parser.add_argument("--end-to-end", type=int, default=0, metavar="N",
                        help="also decode the first N MT-bench questions under each build (0: no)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/kernel_builds.json"))
    args = parser.parse_args()
    row_counts = [int(m) for m in args.rows.split(",")]
    if args.rounds < 1 or min(row_counts) < 1 or args.end_to_end < 0 or args.max_new_tokens < 1:
        parser.error(f"--rounds, --rows and --max-new-tokens must be >= 1 and --end-to-end >= 0; got --rounds "
                     f"{args.rounds}, --rows {args.rows}, --max-new-tokens {args.max_new_tokens}, "
                     f"--end-to-end {args.end_to_end}")
    torch.set_num_threads(1)
    if not rowwise_kernel.available():
        raise SystemExit("the rowwise kernel does not run here (x86 with AVX2 and a compiler are needed)")

    builds = {"default": rowwise_kernel.extension()}
    with tempfile.TemporaryDirectory() as folder:
        builds[args.against] = other_build(args.against, Path(folder))

    lean = LeanModel.from_hf(load_target(args.target).model, 64, packed=True, rowwise=True)
    matrices = [p.codes for p in layer_projections(lean, args.target)]
    inputs = {m: {k: torch.randn(m, k) for k in {c.codes.shape[1] * 32 for c in matrices}} for m in row_counts}

    def product(build, m: int, codes):
        return build.rowwise_linear_blocks(inputs[m][codes.codes.shape[1] * 32], codes.codes, codes.scale, codes.offset,
                                           codes.bits, None)

    for m in row_counts:  # a build that sums in another order is another model
        for codes in matrices:
            if not torch.equal(product(builds["default"], m, codes).view(torch.int32),
                               product(builds[args.against], m, codes).view(torch.int32)):
                raise SystemExit(f"the two builds differ for {m} rows: one of them changed the summation")

    times: dict[tuple[str, int], list[float]] = {(b, m): [] for b in builds for m in row_counts}
    for r in range(args.rounds):
        for m in row_counts:
            for name in (list(builds) if (r + m) % 2 == 0 else list(builds)[::-1]):
                start = time.perf_counter()
                for codes in matrices:
                    product(builds[name], m, codes)
                times[(name, m)].append(time.perf_counter() - start)

    ms = {f"{b}:{m}": 1e3 * statistics.median(v) for (b, m), v in times.items()}
    print(f"layer matrices, one thread, ms (medians of {args.rounds}); same bits from both builds")
    other = args.against
    print(f"{'rows':>4} {other:>10} {'default':>10} {'ratio':>6}")
    for m in row_counts:
        print(f"{m:>4} {ms[f'{other}:{m}']:10.2f} {ms[f'default:{m}']:10.2f} {ms[f'default:{m}'] / ms[f'{other}:{m}']:6.2f}")
    report = {"target": args.target, "against": other, "rounds": args.rounds, "ms": ms,
              f"default_over_{other}": {m: ms[f"default:{m}"] / ms[f"{other}:{m}"] for m in row_counts},
              "default_flags": rowwise_kernel.build_flags(), "torch": torch.__version__, "cpu": cpu_features()}
    if args.end_to_end:
        report["end_to_end"] = end_to_end(builds, args.end_to_end, args.max_new_tokens)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {args.out}")


def end_to_end(builds: dict, questions: int, max_new_tokens: int) -> dict:
    """Plain and chain decoding of MT-bench questions under each build, in rotating order; per-question time
    ratios (default over the other build) and the chain's speedup over plain decoding under each."""
    engine = Engine.load()
    configs = {"plain": GenerationConfig(max_new_tokens=max_new_tokens, strategy="none"),
               "chain": GenerationConfig(max_new_tokens=max_new_tokens)}
    runs = [(build, system) for build in builds for system in configs]
    seconds = {run: [] for run in runs}
    prompts = load_prompts("mtbench", questions)
    if len(prompts) < questions:
        print(f"MT-bench has {len(prompts)} questions: decoding those, not {questions}")

    def decode(build: str, ids: list[int], config: GenerationConfig):
        with mock.patch.object(rowwise_kernel, "extension", lambda: builds[build]):
            return engine.complete_ids(ids, config)

    for build, system in runs:  # a first short run of each, untimed (first-call allocations)
        decode(build, engine.chat_prompt(prompts[0].text), GenerationConfig(max_new_tokens=8,
                                                                            strategy=configs[system].strategy))
    for index, prompt in enumerate(prompts):
        ids = engine.chat_prompt(prompt.text)
        outputs = set()
        for build, system in runs[index % len(runs):] + runs[:index % len(runs)]:
            start = time.perf_counter()
            finished = decode(build, ids, configs[system])
            seconds[(build, system)].append(time.perf_counter() - start)
            outputs.add(tuple(finished.token_ids))
        if len(outputs) != 1:
            raise SystemExit(f"question {prompt.id}: the builds or systems gave different outputs")
    other = next(build for build in builds if build != "default")
    result = {f"{system}_default_over_{other}": statistics.median(
        a / b for a, b in zip(seconds[("default", system)], seconds[(other, system)])) for system in configs}
    for build in builds:
        result[f"chain_speedup_over_plain_{build}"] = statistics.median(
            p / c for p, c in zip(seconds[(build, "plain")], seconds[(build, "chain")]))
    print(f"{len(prompts)} MT-bench questions, {max_new_tokens} tokens, every output the same: " +
          ", ".join(f"{key} {value:.3f}" for key, value in result.items()))
    return {"questions": len(prompts), "max_new_tokens": max_new_tokens, **result,
            "seconds": {f"{b}:{s}": v for (b, s), v in seconds.items()}}


def other_build(against: str, folder: Path):
    """The kernel built as ``--against`` says, in ``folder``."""
    if against == "avx2":
        if not set(rowwise_kernel.AVX512_REGISTER_FLAGS) <= set(rowwise_kernel.build_flags()):
            raise SystemExit("this CPU has no AVX-512: its default build is the AVX2 build, so there is nothing to compare")
        return load("eaglewire_rowwise_linear_avx2", [str(p) for p in rowwise_kernel.SOURCES],
                    extra_cflags=[*rowwise_kernel.COMPILE_FLAGS, "-DEAGLEWIRE_AVX2_ONLY_BUILD"],
                    build_directory=str(folder), verbose=False)
    repo = Path(__file__).resolve().parents[1]
    for path in [*rowwise_kernel.SOURCES, *rowwise_kernel.HEADERS]:
        name = path.relative_to(repo).as_posix()
        shown = subprocess.run(["git", "show", f"{against}:{name}"], cwd=repo, capture_output=True, text=True)
        if shown.returncode:
            raise SystemExit(f"--against {against}: git has no {name} there ({shown.stderr.strip()})")
        (folder / path.name).write_text(shown.stdout)
    return load("eaglewire_rowwise_linear_" + "".join(c for c in against if c.isalnum()),
                [str(folder / p.name) for p in rowwise_kernel.SOURCES], extra_cflags=rowwise_kernel.build_flags(),
                build_directory=str(folder), verbose=False)


if __name__ == "__main__":
    main()
