"""``eaglewire extract``: run the target over conversations and store the wiring's hidden states.

Records are split into fixed chunks of ``shard_records`` source records; chunk
c is written by process ``c % world_size`` as one atomic shard file. A shard
that exists is finished, so a rerun after Ctrl-C or a kill redoes only the
chunks that were in flight, and the shards do not depend on how many
processes ran. The last step (rank 0) hashes every shard into the manifest.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from tqdm import tqdm

from ..distributed import World, init_world
from ..dtypes import DTYPES, parse_dtype
from ..errors import ConfigError
from ..files import remove_stale_temporaries, sha256_file
from ..target import DEFAULT_TARGET, Target, chat_template_of, load_target
from ..wiring import Wiring
from .capture import capture
from .chat import SkipRecord, prepare_record
from .conversations import DataError, Record, iter_records, open_source
from .manifest import (
    MANIFEST,
    Manifest,
    ManifestError,
    RunSettings,
    ShardEntry,
    load_manifest,
)
from .probe import check_probe, probe_for
from .samples import is_held_out
from .shards import (
    Sample,
    ShardError,
    ShardMeta,
    read_shard_meta,
    shard_name,
    write_shard,
)


@dataclass
class ExtractConfig:
    data: str
    out: Path
    target: str = DEFAULT_TARGET
    wiring: str | None = None  # None: Wiring.default(num_layers)
    max_samples: int | None = None
    max_length: int = 2048
    dtype: str = "bf16"
    shard_records: int = 64
    strict: bool = False
    held_out_only: bool = False  # the records training holds out, and no others: data for `doctor` at 1/50 the cost
    progress: bool = True

    def __post_init__(self) -> None:
        self.out = Path(self.out)
        parse_dtype(self.dtype, "--dtype")
        for name in ("max_length", "shard_records"):
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.max_samples is not None and self.max_samples < 1:
            raise ConfigError(f"--max-samples must be >= 1, got {self.max_samples}")


@dataclass
class _Chunk:
    """The shard being filled: chunk index, samples and skip bookkeeping."""

    index: int
    first_record: int
    samples: list[Sample] = field(default_factory=list)
    skipped: int = 0
    first_skipped: str | None = None
    skip_reasons: dict[str, int] = field(default_factory=dict)

    def skip(self, record: Record, reason: str, detail: str) -> None:
        self.skipped += 1
        self.skip_reasons[reason] = self.skip_reasons.get(reason, 0) + 1
        if self.first_skipped is None:
            self.first_skipped = f"{record.where}: {detail}"


def prepare_output(out: Path, settings: RunSettings, probe: dict) -> Manifest:
    """Start a new dataset in ``out`` or reopen a compatible unfinished one; refuse anything else."""
    if out.exists() and not out.is_dir():
        raise ManifestError(f"--out {out} is a file; give a folder")
    if out.is_dir() and any(out.iterdir()):
        if not (out / MANIFEST).is_file():
            raise ManifestError(f"--out {out} already holds files that are not an eaglewire dataset; choose an empty or new folder")
        existing = load_manifest(out)
        diffs = settings.differences(existing.settings)
        if diffs and not existing.complete and not list(out.glob("shard-*.safetensors")):
            # An attempt that failed before writing any shard (e.g. bad data since fixed): nothing to lose.
            diffs = []
            existing = Manifest(settings, probe)
            existing.save(out)
        if diffs:
            raise ManifestError(
                f"--out {out} already holds a dataset made with different settings ({'; '.join(diffs)}). "
                "Nothing was changed; use another --out, or delete that folder to start over."
            )
        return existing
    out.mkdir(parents=True, exist_ok=True)
    manifest = Manifest(settings, probe)
    manifest.save(out)
    return manifest


def finished_chunks(out: Path, settings_sha256: str) -> set[int]:
    done = set()
    for path in sorted(out.glob("shard-*.safetensors")):
        meta = read_shard_meta(path)
        if meta.settings_sha256 != settings_sha256:
            raise ShardError(f"{path} was written by a run with other settings; delete it or use another --out")
        done.add(meta.chunk)
    return done


def finalize(out: Path, manifest: Manifest, total_records: int) -> Manifest:
    """Hash every shard into the manifest and mark it complete; refuses if a chunk is missing."""
    S = manifest.settings.shard_records
    entries, skipped = [], {}
    for chunk in range((total_records + S - 1) // S):
        path = out / shard_name(chunk)
        if not path.is_file():
            raise ShardError(f"shard {path.name} is missing (a process stopped early); rerun the same command to finish")
        meta = read_shard_meta(path)
        entries.append(ShardEntry(path.name, chunk, meta.first_record, meta.end_record, meta.samples, meta.tokens,
                                  meta.loss_tokens, meta.skipped, path.stat().st_size, sha256_file(path)))
        for reason, count in meta.skip_reasons.items():
            skipped[reason] = skipped.get(reason, 0) + count
        if meta.first_skipped and "first" not in skipped:
            skipped["first"] = meta.first_skipped
    manifest.shards = entries
    manifest.skipped = skipped
    manifest.totals = {
        "records": total_records,
        "samples": sum(e.samples for e in entries),
        "tokens": sum(e.tokens for e in entries),
        "loss_tokens": sum(e.loss_tokens for e in entries),
        "skipped": sum(e.skipped for e in entries),
        "bytes": sum(e.bytes for e in entries),
    }
    manifest.complete = True
    manifest.save(out)
    return manifest


class _Progress:
    """Rank 0's bar: conversations read, samples written, tokens/s and ETA."""

    def __init__(self, enabled: bool, max_samples: int | None, source_bytes: int):
        self.bar = tqdm(total=max_samples, unit="conv", disable=not enabled, dynamic_ncols=True, desc="extract")
        self.estimate_total = max_samples is None
        self.source_bytes = source_bytes
        self.start = time.perf_counter()
        self.tokens = self.samples = self.skipped = 0

    def advance(self, records_read: int, bytes_read: int) -> None:
        if self.estimate_total and bytes_read:
            self.bar.total = max(records_read, int(records_read * self.source_bytes / bytes_read))
        self.bar.update(records_read - self.bar.n)
        rate = self.tokens / max(time.perf_counter() - self.start, 1e-9)
        self.bar.set_postfix(samples=self.samples, skipped=self.skipped, tok_s=f"{rate:.0f}", refresh=False)

    def close(self) -> None:
        self.bar.close()


def run_extract(cfg: ExtractConfig, target: Target | None = None, world: World | None = None) -> Manifest:
    world = world or init_world()
    source = open_source(cfg.data)  # cheap checks first: fail before loading a model
    target = target or load_target(cfg.target)
    wiring = Wiring.resolve(cfg.wiring, target.num_layers)
    template = chat_template_of(target.tokenizer)
    settings = RunSettings(target.fingerprint, wiring.to_json(), cfg.dtype, cfg.max_length, cfg.shard_records,
                           cfg.max_samples, source.identity(), template, cfg.held_out_only)
    if world.is_main:
        probe = probe_for(target, wiring)
        manifest = prepare_output(cfg.out, settings, probe)
        # Same fingerprint is not enough: the capture code itself must still produce the recorded values.
        check_probe(manifest.probe, probe, f"the dataset in {cfg.out}")
        remove_stale_temporaries(cfg.out)
    world.barrier()
    if not world.is_main:
        manifest = load_manifest(cfg.out)
    if manifest.complete:
        return _require_samples(manifest)
    done = finished_chunks(cfg.out, settings.sha256())
    total_records = _extract_chunks(cfg, target, wiring, settings.sha256(), source, done, world)
    world.barrier()
    if world.is_main:
        manifest = finalize(cfg.out, manifest, total_records)
    world.barrier()
    return _require_samples(load_manifest(cfg.out))


def _require_samples(manifest: Manifest) -> Manifest:
    """A dataset without one usable sample is an error, so that `extract && train` stops here."""
    totals, skipped = manifest.totals, dict(manifest.skipped)
    if totals["samples"] > 0:
        return manifest
    first = skipped.pop("first", None)
    reasons = ", ".join(f"{reason}: {count}" for reason, count in skipped.items())
    raise DataError(f"no usable sample: all {totals['records']} records were skipped ({reasons}); "
                    f"the first: {first}. Fix the data (or its schema) and run the same command again")


def _extract_chunks(cfg, target, wiring, settings_sha, source, done, world) -> int:
    """Fill every chunk this process owns that is not done; returns the number of source records."""
    points, store_dtype, S = wiring.points, DTYPES[cfg.dtype], cfg.shard_records
    template = chat_template_of(target.tokenizer)
    progress = _Progress(cfg.progress and world.is_main, cfg.max_samples, source.size)
    bytes_read = [0]
    writer = ThreadPoolExecutor(max_workers=1)  # overlaps disk writes with the next forward passes
    pending: list[Future] = []
    chunk: _Chunk | None = None
    records = 0

    def flush(end_record: int) -> None:
        if chunk is None or chunk.index % world.size != world.rank or chunk.index in done:
            return
        for future in pending:
            future.result()  # at most one shard waits in memory
        pending.clear()
        meta = ShardMeta(chunk.index, chunk.first_record, end_record, len(chunk.samples),
                         sum(len(s.input_ids) for s in chunk.samples),
                         sum(int(s.loss_mask.sum()) for s in chunk.samples), settings_sha,
                         chunk.skipped, chunk.first_skipped, chunk.skip_reasons)
        pending.append(writer.submit(write_shard, cfg.out / shard_name(chunk.index), chunk.samples, points, meta))

    try:
        for record in iter_records(source, bytes_read):
            if cfg.max_samples is not None and record.index >= cfg.max_samples:
                break
            index = record.index // S
            if chunk is None or index != chunk.index:
                flush(record.index)
                chunk = _Chunk(index, index * S)
            records = record.index + 1
            wanted = is_held_out(record.index) or not cfg.held_out_only
            if index % world.size == world.rank and index not in done and wanted:
                _process(record, chunk, cfg, target, template, points, store_dtype, progress)
            progress.advance(records, bytes_read[0])
        flush(records)
        for future in pending:
            future.result()
    finally:
        writer.shutdown(wait=True)  # a started shard write always completes (it is atomic anyway)
        progress.close()
    if records == 0:
        raise DataError(f"{source.path} holds no conversation records")
    return records


def _process(record, chunk, cfg, target, template, points, store_dtype, progress) -> None:
    try:
        tokens = prepare_record(record, target.tokenizer, template, cfg.max_length)
    except SkipRecord as skip:
        skip.refuse_if_strict(record, cfg.strict)
        chunk.skip(record, skip.reason, str(skip))
        progress.skipped += 1
        return
    hidden = capture(target.layout, points, tokens.input_ids[None], dtype=store_dtype)
    chunk.samples.append(Sample(record.index, tokens.input_ids, tokens.loss_mask, {p: h[0] for p, h in hidden.items()}))
    progress.samples += 1
    progress.tokens += len(tokens.input_ids)
