"""The eaglewire half of the speculators interop check (run by speculators_check.sh with eaglewire's venv).

Writes into --work:
  verifier/         the target (SmolLM2 from its GGUF, fp32) as a Hugging Face folder, as speculators loads a verifier
  speculators/      the drafter (--drafter, default the shipped one), `eaglewire export --to speculators --verifier verifier/`
  drafter/          with --add-random-layer: the drafter grown by one layer filled at random
  eagle/            the drafter, `eaglewire export --to eagle` (input for `speculators convert`); not for a drafter of
                    more than one decoder layer, which EAGLE cannot build
  inputs.safetensors  token ids, the target's aux states for the drafter's wiring, and eaglewire's drafter
                    logits for 3 TTT steps (fp32), on real SmolLM2 text: chat prompts and the target's greedy answers
  eaglewire.json    what was written, for the speculators half
"""

from __future__ import annotations

import argparse
import copy
import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

from eaglewire.data.capture import capture
from eaglewire.drafter.checkpoint import load_checkpoint, save_checkpoint
from eaglewire.drafter.shipped import shipped_drafter
from eaglewire.interop.formats import export_checkpoint
from eaglewire.target import DEFAULT_TARGET, load_target
from eaglewire.train.drafter_growth import with_num_layers
from eaglewire.train.ttt import unroll

TTT_STEPS = 3
PROMPTS = (
    "Why is the sky blue? Answer in two sentences.",
    "Write a short poem about a lighthouse.",
    "What is the difference between a list and a tuple in Python?",
)
ANSWER_TOKENS = 48


def save_hf_copy(target, folder: Path) -> None:
    """The target as a plain Hugging Face folder: the dequantized GGUF weights eaglewire trains and serves on,
    in fp32. transformers refuses to save a GGUF-loaded model, so its weights go into a model built from its
    config without the GGUF quantization record."""
    config = copy.deepcopy(target.model.config)
    del config.quantization_config  # the GGUF loader's record; the copy holds plain dequantized weights
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(target.model.state_dict(), strict=True)
    model.save_pretrained(folder)
    target.tokenizer.save_pretrained(folder)


def with_random_layer(folder: Path, target, out: Path) -> Path:
    """The drafter in ``folder`` with one more decoder layer whose every weight matters: a later layer grown for
    training passes its input through, and norms left at one would hide a norm read under the wrong name."""
    checkpoint = load_checkpoint(folder, target.layout.embed)
    drafter, _ = with_num_layers(checkpoint.drafter.float(), checkpoint.drafter.config.num_layers + 1,
                                 target.layout.embed)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in drafter.layers[str(drafter.config.num_layers - 1)].named_parameters():
            if "norm" in name:
                param.copy_(torch.empty_like(param).uniform_(0.5, 1.5, generator=generator))
            else:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.02)
    dtype = checkpoint.drafter.fc.weight.dtype
    return save_checkpoint(out, drafter, checkpoint.meta, dtype=dtype)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--drafter", type=Path, default=None, help="a native checkpoint (default: the shipped drafter)")
    parser.add_argument("--add-random-layer", action="store_true",
                        help="check a second decoder layer: grow the drafter by one layer and fill it at random "
                             "(weights N(0, 0.02), norm weights uniform in 0.5-1.5, seed 0), saved in --work")
    args = parser.parse_args()
    work = args.work
    work.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)

    target = load_target(DEFAULT_TARGET)
    verifier = work / "verifier"
    if not (verifier / "config.json").is_file():
        save_hf_copy(target, verifier)
    folder = args.drafter or shipped_drafter(DEFAULT_TARGET)
    if args.add_random_layer:
        folder = with_random_layer(folder, target, work / "drafter")
    for name in ("speculators", "eagle"):
        if (work / name).exists():
            raise SystemExit(f"{work / name} exists; give a fresh --work folder")
    checkpoint = load_checkpoint(folder, target.layout.embed)
    spec = export_checkpoint(folder, "speculators", work / "speculators", verifier=str(verifier), target=target)
    one_layer = checkpoint.drafter.config.num_layers == 1
    if one_layer:
        export_checkpoint(folder, "eagle", work / "eagle")
    eagle = f" and --to eagle ({work / 'eagle'})" if one_layer else " (not --to eagle: EAGLE builds one layer)"
    print(f"exported {folder} --to speculators ({work / 'speculators'}){eagle}; "
          f"wiring {spec.wiring}, ids {spec.ids}; warnings: {list(spec.warnings) or 'none'}")

    drafter = checkpoint.drafter.float().eval()
    wiring = checkpoint.meta.wiring
    tensors, samples = {}, []
    for i, prompt in enumerate(PROMPTS):
        ids = target.tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                                   return_tensors="pt", return_dict=False)
        with torch.no_grad():
            out = target.model.generate(ids, max_new_tokens=ANSWER_TOKENS, do_sample=False,
                                        pad_token_id=target.tokenizer.eos_token_id)
            states = capture(target.layout, wiring.aux, out)
            aux = torch.cat([states[p][0] for p in wiring.aux], dim=-1).float()  # [T, 3H], in wiring order
            logits = unroll(drafter, out[0], aux, TTT_STEPS)  # per step [T-1, Vd]
        tensors[f"s{i}.input_ids"] = out[0].contiguous()
        tensors[f"s{i}.aux"] = aux.contiguous()
        for k, step in enumerate(logits, start=1):
            tensors[f"s{i}.logits{k}"] = step.float().contiguous()
        samples.append({"prompt": prompt, "tokens": int(out.shape[1])})
    save_file(tensors, work / "inputs.safetensors")
    (work / "eaglewire.json").write_text(json.dumps({
        "drafter": str(folder), "verifier": str(verifier), "speculators_export": str(work / "speculators"),
        "eagle_export": str(work / "eagle") if one_layer else None, "wiring": str(wiring), "ids": spec.ids, "ttt_steps": TTT_STEPS,
        "samples": samples, "num_layers": target.num_layers, "drafter_layers": checkpoint.drafter.config.num_layers,
    }, indent=2))
    print(f"eaglewire logits for {TTT_STEPS} TTT steps on {len(samples)} samples "
          f"({sum(s['tokens'] for s in samples)} tokens) -> {work / 'inputs.safetensors'}")


if __name__ == "__main__":
    main()
