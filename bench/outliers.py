"""Outlier activation channels: what they cost the fast runtime profile's 8-bit activations.

    python bench/outliers.py [--scales 1,16,64] [--channels 4] [--windows 16] [--schemes q8,q4,q4-gptq]

Real LLMs carry a few hidden channels whose activations are tens to a hundred times larger than
the rest (Dettmers et al., "LLM.int8()", 2022); models trained for minutes have none. This plants
them in the trained Llama of bench/quality.py without changing its function: for ``--channels``
hidden channels, every RMSNorm that feeds linears (``input_layernorm`` -> q/k/v,
``post_attention_layernorm`` -> gate/up) has its gain multiplied by the scale and those linears'
input columns divided by it. Scales are powers of two, so the fp32 model computes exactly what
the original does (checked: the logits are bit-identical); only the linears' *inputs* now hold
outliers, which the fast profile quantizes to 8 bits per token. Each variant is exported under
each scheme and scored in MNN's runtime under both profiles against the original model in HF fp32
(bench/quality.py's windows and statistics).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from quality import CALIBRATION_TEXT, SCHEMES, export, reference_logits, weight_bytes  # noqa: E402

from llmexport.mnn.config import PROFILE_KEYS, RuntimeProfile  # noqa: E402
from llmexport.mnn.runtime import run_windows  # noqa: E402
from llmexport.tiny.trained import RECIPES, bos_id, default_corpus, encode, trained_checkpoint  # noqa: E402
from llmexport.verification.quality import compare, windows  # noqa: E402

#: norm -> the linears it feeds, in a Llama decoder layer
FEEDS = {"input_layernorm": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
         "post_attention_layernorm": ("mlp.gate_proj", "mlp.up_proj")}


def plant(source: Path, out: Path, scale: float, channels: list[int]) -> Path:
    """A copy of the checkpoint with outlier activations in ``channels`` (module docstring)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            for norm, linears in FEEDS.items():
                getattr(layer, norm).weight[channels] *= scale
                for name in linears:
                    layer.get_submodule(name).weight[:, channels] /= scale
    model.save_pretrained(out, safe_serialization=True)
    for extra in source.iterdir():
        if extra.suffix in (".json", ".jinja") and not (out / extra.name).exists():
            shutil.copy(extra, out / extra.name)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scales", default="1,16,64")
    parser.add_argument("--channels", type=int, default=4)
    parser.add_argument("--windows", type=int, default=16)
    parser.add_argument("--schemes", default="q8,q4")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    corpus = default_corpus()
    recipe = RECIPES["llama"]
    source = trained_checkpoint(recipe, corpus, log=lambda line: print(line, file=sys.stderr))
    wins = windows(encode(source, corpus.heldout), recipe.seq_len, args.windows, bos_id(source))
    targets = np.concatenate([np.array(w[1:]) for w in wins])
    ref, _ = reference_logits(source, wins)
    hidden = json.loads((source / "config.json").read_text())["hidden_size"]
    channels = list(torch.randperm(hidden, generator=torch.Generator().manual_seed(0))[:args.channels].tolist())
    work = Path(tempfile.mkdtemp(prefix="llmexport-bench-outliers-"))
    rows = []
    calibration_text = work / "calibration.txt"  # for the -gptq schemes: the training text
    calibration_text.write_text(corpus.train, encoding="utf-8")
    try:
        for scale in map(float, args.scales.split(",")):
            planted = plant(source, work / f"x{scale:g}", scale, channels)
            same = np.array_equal(reference_logits(planted, wins[:2])[0], ref[:2 * (len(wins[0]) - 1)])
            for scheme in args.schemes.split(","):
                dst = work / f"x{scale:g}-{scheme}"
                export(planted, dst, [str(calibration_text) if f == CALIBRATION_TEXT else f for f in SCHEMES[scheme]])
                for profile in RuntimeProfile:
                    start = time.perf_counter()
                    mnn = np.concatenate(run_windows(dst, wins, {"thread_num": 2, **PROFILE_KEYS[profile]}))
                    stats = compare(ref, mnn, targets)
                    rows.append({"scale": scale, "scheme": scheme, "profile": profile.value, "fp32_identical": same,
                                 **stats.to_json(), "weight_mib": weight_bytes(dst) / 2**20,
                                 "score_s": round(time.perf_counter() - start, 1)})
                    print(json.dumps(rows[-1]), file=sys.stderr)
                shutil.rmtree(dst, ignore_errors=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    print("| outlier scale | scheme | profile | HF fp32 unchanged | KLD mean | KLD p99 | top-1 |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['scale']:g} | {r['scheme']} | {r['profile']} | {r['fp32_identical']} | {r['kld_mean']:.2e} | "
              f"{r['kld_p99']:.2e} | {100 * r['top1']:.2f}% |")


if __name__ == "__main__":
    main()
