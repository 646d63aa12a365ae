"""The speculators half of the interop check (run by speculators_check.sh in a venv with speculators==0.9.0).

Loads eaglewire's `--to speculators` export with speculators' own `Eagle3DraftModel.from_pretrained`, as a
speculators user would, and checks:
  - which of the model's weights the folder did not provide (only the verifier-owned ones speculators fills
    itself from the verifier may be missing), and that none is left NaN;
  - that its token embedding equals the target's (the verifier folder's);
  - that its drafter logits agree with eaglewire's on the same real SmolLM2 aux states, per TTT step
    (speculators' own training-time-test forward: step k reads the previous step's output and token x[t+k]);
then runs `speculators convert` on the `--to eagle` export and compares the result tensor for tensor with the
`--to speculators` export. Prints the figures and writes them as JSON (--out).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import subprocess
import sys
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file

# What speculators fills from the verifier itself (speculators/model.py load_verifier_weights; not saved).
VERIFIER_OWNED = {"verifier_lm_head.weight", "verifier_norm.weight"}
BLOCK = 128  # flex attention's block size in torch 2.13, which speculators' block masks are built on


def verifier_tensor(folder: Path, suffix: str) -> torch.Tensor:
    with safe_open(str(folder / "model.safetensors"), framework="pt") as handle:
        names = [k for k in handle.keys() if k.endswith(suffix)]
        if len(names) != 1:
            raise SystemExit(f"{folder}: expected one *{suffix}, found {names}")
        return handle.get_tensor(names[0])


def load_as_a_user(export: Path):
    """Eagle3DraftModel.from_pretrained(folder), in fp32; also what the folder did not provide."""
    from speculators.models.eagle3 import Eagle3DraftModel

    model = Eagle3DraftModel.from_pretrained(str(export), dtype=torch.float32).eval()
    with safe_open(str(export / "model.safetensors"), framework="pt") as handle:
        in_file = set(handle.keys())
    state = model.state_dict()
    missing = sorted(set(state) - in_file)
    unexpected = sorted(in_file - set(state))
    nan = sorted(k for k, t in state.items() if t.is_floating_point() and t.isnan().any())
    return model, {"missing_from_folder": missing, "unexpected_in_folder": unexpected, "nan_after_load": nan,
                   "missing_beyond_verifier_owned": sorted(set(missing) - VERIFIER_OWNED)}


def speculators_logits(model, input_ids: torch.Tensor, aux: torch.Tensor, steps: int) -> list[torch.Tensor]:
    """speculators' forward over x[1..T-1] with aux[0..T-2], positions 0..T-2 (eaglewire's alignment, ttt.py);
    its lm_head output per TTT step, caught by a hook (the forward itself returns only the argmax tokens).

    Its default attention (flex attention with a block mask) needs the packed length to be a multiple of its
    128-token block, as speculators' training batches are: the sample is padded with a second document, which
    the document mask keeps out of the sample's attention.
    """
    length = input_ids.shape[0] - 1
    padded = -(-length // BLOCK) * BLOCK
    pad = padded - length
    ids = torch.cat([input_ids[1:], input_ids.new_zeros(pad)])[None]
    hidden = torch.cat([aux[:length], aux.new_zeros(pad, aux.shape[1])])[None]
    documents = torch.cat([torch.zeros(length, dtype=torch.long), torch.ones(pad, dtype=torch.long)])[None]
    caught: list[torch.Tensor] = []
    handle = model.lm_head.register_forward_hook(lambda module, args, out: caught.append(out.detach()[0, :length].clone()))
    try:
        with torch.no_grad():
            model(hidden_states=hidden, input_ids=ids, document_ids=documents,
                  position_ids=torch.arange(padded)[None], ttt_steps=steps)
    finally:
        handle.remove()
    if len(caught) != steps:
        raise SystemExit(f"speculators' lm_head ran {len(caught)} times for {steps} TTT steps")
    return caught


def compare_logits(model, inputs: dict, meta: dict) -> list[dict]:
    steps = meta["ttt_steps"]
    agree, total, worst, scale = [0] * steps, [0] * steps, [0.0] * steps, [0.0] * steps
    for i in range(len(meta["samples"])):
        ids, aux = inputs[f"s{i}.input_ids"].long(), inputs[f"s{i}.aux"]
        for k, theirs in enumerate(speculators_logits(model, ids, aux, steps)):
            ours = inputs[f"s{i}.logits{k + 1}"]
            # Step k+1 at base position t predicts x[t+k+2]; positions whose input token ran past the end are padding.
            valid = ids.shape[0] - 1 - k
            theirs, ours = theirs[:valid], ours[:valid]
            agree[k] += int((theirs.argmax(-1) == ours.argmax(-1)).sum())
            total[k] += valid
            worst[k] = max(worst[k], float((theirs - ours).abs().max()))
            scale[k] = max(scale[k], float(ours.abs().max()))
    return [{"step": k + 1, "positions": total[k], "argmax_agreement": agree[k] / total[k],
             "max_abs_dlogit": worst[k], "max_abs_logit": scale[k]} for k in range(steps)]


def embedding_check(model, verifier: Path, dtype: torch.dtype) -> dict:
    """The loaded drafter's embedding against the target's, which the export stores in the drafter's dtype."""
    embed = model.embed_tokens.weight.detach()
    table = verifier_tensor(verifier, "embed_tokens.weight").float()
    return {"dtype": str(dtype).removeprefix("torch."),
            "equals_target": bool(torch.equal(embed, table.to(dtype).float())),
            "max_abs_delta_fp32": float((embed - table).abs().max()), "all_zero": bool((embed == 0).all())}


def run_convert(meta: dict, work: Path) -> dict:
    """`speculators convert` on the --to eagle export, as its docs show; then tensor for tensor vs our export."""
    out = work / "converted"
    command = [str(Path(sys.executable).parent / "speculators"), "convert", meta["eagle_export"], "--algorithm",
               "eagle3", "--verifier", meta["verifier"], "--output-path", str(out),
               # EAGLE folders carry no ids (EAGLE captures hard-coded ones): tell convert, as a user would.
               "--algorithm-kwargs", json.dumps({"eagle_aux_hidden_state_layer_ids": meta["ids"]})]
    done = subprocess.run(command, capture_output=True, text=True)
    result = {"command": " ".join(command), "returncode": done.returncode}
    if done.returncode != 0:
        result["error"] = (done.stdout + done.stderr)[-3000:]
        return result
    theirs = load_file(out / "model.safetensors")
    ours = load_file(Path(meta["speculators_export"]) / "model.safetensors")
    result["only_in_convert"] = sorted(set(theirs) - set(ours))
    result["only_in_export"] = sorted(set(ours) - set(theirs))
    differ = {}
    for key in sorted(set(theirs) & set(ours)):
        a, b = theirs[key], ours[key]
        if a.shape != b.shape or a.dtype != b.dtype or not torch.equal(a, b):
            differ[key] = (f"convert {tuple(a.shape)} {a.dtype} vs export {tuple(b.shape)} {b.dtype}"
                           + (f", max |delta| {float((a.float() - b.float()).abs().max()):.3g}" if a.shape == b.shape else ""))
    result["equal_tensors"] = len(set(theirs) & set(ours)) - len(differ)
    result["different_tensors"] = differ
    config = json.loads((out / "config.json").read_text())
    result["config_ids"] = config.get("eagle_aux_hidden_state_layer_ids")
    # And the converted folder loaded as a user would: what embedding does it draft with?
    converted, loading = load_as_a_user(out)
    result["loaded"] = loading | {"embedding": embedding_check(converted, Path(meta["verifier"]),
                                                               theirs["fc.weight"].dtype)}
    result["config_flags"] = {k: config.get(k) for k in ("norm_before_residual", "norm_before_fc", "fc_norm",
                                                          "norm_output")}
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    meta = json.loads((args.work / "eaglewire.json").read_text())
    inputs = load_file(args.work / "inputs.safetensors")
    export, verifier = Path(meta["speculators_export"]), Path(meta["verifier"])
    versions = {name: importlib.metadata.version(name) for name in ("speculators", "transformers", "torch")}
    print(f"speculators side: {versions}")

    model, loading = load_as_a_user(export)
    stored_dtype = load_file(export / "model.safetensors")["fc.weight"].dtype
    embedding = embedding_check(model, verifier, stored_dtype)
    verifier_norm = bool(torch.equal(model.verifier_norm.weight.detach(), verifier_tensor(verifier, "model.norm.weight")))
    print(f"loaded {export} with Eagle3DraftModel.from_pretrained: missing from the folder {loading['missing_from_folder']} "
          f"(beyond the verifier-owned ones: {loading['missing_beyond_verifier_owned'] or 'none'}); unexpected "
          f"{loading['unexpected_in_folder'] or 'none'}; NaN after load {loading['nan_after_load'] or 'none'}")
    print(f"embedding equals the target's in the drafter's dtype ({embedding['dtype']}): {embedding['equals_target']} "
          f"(max |delta| to the fp32 table {embedding['max_abs_delta_fp32']:.3g}, its rounding to {embedding['dtype']}); "
          f"verifier_norm filled from the verifier: {verifier_norm}; layer ids {model.config.eagle_aux_hidden_state_layer_ids}")

    rows = compare_logits(model, inputs, meta)
    for row in rows:
        print(f"TTT step {row['step']}: argmax agreement {row['argmax_agreement']:.4f} over {row['positions']} positions, "
              f"max |dlogit| {row['max_abs_dlogit']:.3g} (logits up to {row['max_abs_logit']:.3g})")

    if meta["eagle_export"] is None:  # a deeper drafter: EAGLE builds one layer, so there is no --to eagle folder
        convert = {"skipped": f"a drafter of {meta['drafter_layers']} decoder layers has no --to eagle export"}
        print(f"speculators convert: {convert['skipped']}")
    elif (convert := run_convert(meta, args.work))["returncode"] != 0:
        print(f"speculators convert failed (exit {convert['returncode']}):\n{convert['error']}")
    else:
        print(f"speculators convert of the --to eagle export vs our --to speculators export: "
              f"{convert['equal_tensors']} tensors equal; different: {convert['different_tensors'] or 'none'}; only in "
              f"convert: {convert['only_in_convert'] or 'none'}; only in our export: {convert['only_in_export'] or 'none'}; "
              f"its ids {convert['config_ids']}, flags {convert['config_flags']}")
        loaded = convert["loaded"]
        print(f"  the converted folder loaded with from_pretrained: missing from the folder "
              f"{loaded['missing_from_folder']}; embedding equals the target's: {loaded['embedding']['equals_target']}, "
              f"all zero: {loaded['embedding']['all_zero']}")

    report = {"versions": versions, "drafter": meta["drafter"], "export": str(export), "verifier": str(verifier), "wiring": meta["wiring"],
              "ids": meta["ids"], "samples": meta["samples"], "loading": loading, "embedding": embedding,
              "verifier_norm_from_verifier": verifier_norm,
              "model_layer_ids": list(model.config.eagle_aux_hidden_state_layer_ids),
              "drafter_layers": meta["drafter_layers"], "model_layers": len(model.layers), "ttt_steps": rows,
              "convert": convert}
    ok = (not loading["missing_beyond_verifier_owned"] and not loading["nan_after_load"] and embedding["equals_target"]
          and all(r["argmax_agreement"] == 1.0 for r in rows))
    report["ok"] = ok
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"{'OK' if ok else 'MISMATCH'}: wrote {args.out}")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
