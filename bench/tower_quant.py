"""What storing the multimodal towers costs: fp16 / int8 / int4 tower linears vs the bf16 checkpoint.

    python bench/tower_quant.py            # E2B tower dimensions, 280-token images, 4 s clips
    python bench/tower_quant.py --quick    # 70-token images, 1 s clips (a few minutes)
    python bench/tower_quant.py --runtime  # what the bits save: exported file sizes, MNN peak memory

The towers are HF's own modules (``Gemma4Model.get_image_features`` / ``get_audio_features``) at
transformers' default vision/audio configs, which have the E2B/E4B towers' dimensions (vision:
16 layers, hidden 768; audio: 12 Conformer layers, hidden 1024), and a text hidden size of 1536.
Weights, two ways (no real weights are downloaded):

  hf-init  exactly as transformers' ``_init_weights`` leaves a new model (linears N(0, 0.02^2),
           norms 1, clip bounds infinite, HF's audio timescales);
  heavy    hf-init, with every tower linear replaced by a heavy-tailed matrix (Student-t, 3 to 5
           degrees of freedom, and a few input channels 10-50x larger), the shape of trained
           transformer weights that makes block quantization hardest (bench/quant.py's matrices).

The checkpoint's weights are rounded to bf16 first, as the released checkpoints are; the
reference is the tower carrying them (fp32 compute). Every linear the export quantizes (the
tower's ``tower_linears``) then gets what MNN decodes from the export's record of it: fp16
(exact for bf16 values in fp16's normal range), ``dequantize(quantize_rtn(w, bits, block))``
(asymmetric, block 64 or its divisor) for 8 and 4 bits. The row ``bf16`` is a yardstick: what
that rounding of fp32 weights moves the soft tokens by, i.e. noise the released (bf16) towers
live with. The exported towers run in MNN within 2e-5 of HF with the stored weights
(tests/test_vision_export.py, test_audio_export.py), so this is the cost of the bits in the
runtime. Reported per tower, weights and bits: max |diff| / max |ref| over the soft tokens (the
verification's metric), the RMS relative error ||diff|| / ||ref||, and the worst per-token cosine
similarity, each the worst over the inputs.

``--runtime`` exports a checkpoint with E2B-sized towers (random weights, a tiny text model) at
each bit width and runs ``visual.mnn`` / ``audio.mnn`` alone in MNN (fp32 activations and memory
"normal", as the export's ``mllm`` block asks) on a 280-token image and a 4 s clip: the weight
file's size and the MNN process's peak RSS. (Seconds per forward are left out: on a machine
shared with other jobs they varied by more than the bit widths could.)
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from llmexport.quant.rtn import dequantize, quantize_rtn  # noqa: E402
from llmexport.quant.scheme import QuantScheme  # noqa: E402

BITS = (16, 8, 4)
BF16 = "bf16"  # the precision the released checkpoints are stored in (not an export choice)
BLOCK = 64
TEXT_HIDDEN = 1536  # E2B


class _Weights(dict):
    """The checkpoint-name lookup the tower classes read clip scalars through."""

    folder = Path("bench-model")  # named in the tower code's error messages

    def tensor(self, name):
        return self[name]


def build_model(seed: int):
    """HF Gemma4 with the default (E2B-sized) towers and a one-layer text model."""
    from transformers import (
        Gemma4AudioConfig,
        Gemma4Config,
        Gemma4ForConditionalGeneration,
        Gemma4TextConfig,
        Gemma4VisionConfig,
    )

    text = Gemma4TextConfig(vocab_size=512, vocab_size_per_layer_input=512, hidden_size=TEXT_HIDDEN,
                            intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                            head_dim=64, global_head_dim=64, hidden_size_per_layer_input=0,
                            layer_types=["full_attention"], num_kv_shared_layers=0)
    config = Gemma4Config(text_config=text.to_dict(), vision_config=Gemma4VisionConfig().to_dict(),
                          audio_config=Gemma4AudioConfig().to_dict())
    torch.manual_seed(seed)
    return Gemma4ForConditionalGeneration(config).eval()


def tower_linears(model, tower: str) -> list[str]:
    """Checkpoint names of the weights the export quantizes for ``tower`` (its own list)."""
    from llmexport.models.gemma4.audio import audio_linears, parse_audio_args
    from llmexport.models.gemma4.vision import parse_vision_args, vision_linears

    weights = _Weights(model.state_dict())
    config = model.config.to_dict()
    if tower == "visual":
        linears = vision_linears(parse_vision_args(config["vision_config"], TEXT_HIDDEN, "bench"), weights)
    else:
        linears = audio_linears(parse_audio_args(config["audio_config"], TEXT_HIDDEN, "bench"), weights)
    return [linear.weight for linear in linears]


def heavy_tailed(shape: tuple[int, int], generator: torch.Generator) -> torch.Tensor:
    oc, ic = shape
    dof = float(3 + 2 * torch.rand((), generator=generator))
    w = torch.distributions.StudentT(dof).sample((oc, ic)) * 0.02
    outliers = torch.randperm(ic, generator=generator)[:max(1, ic // 256)]
    w[:, outliers] *= 10 + 40 * torch.rand(len(outliers), generator=generator)
    return w


def stored(w: torch.Tensor, bits) -> torch.Tensor:
    """What MNN decodes from the export's record of ``w`` (``BF16``: ``w`` rounded to bf16)."""
    if bits == BF16:
        return w.to(torch.bfloat16).float()
    if bits == 16:
        return w.to(torch.float16).float()
    return dequantize(quantize_rtn(w.float(), bits, QuantScheme(bits, BLOCK).block_for(w.shape[1])))


def inputs(tower: str, quick: bool) -> list[tuple]:
    from transformers.models.gemma4.feature_extraction_gemma4 import Gemma4AudioFeatureExtractor
    from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil

    from llmexport.media.audio import synthetic_clip
    from llmexport.media.image import synthetic_image

    if tower == "visual":
        processor = Gemma4ImageProcessorPil(max_soft_tokens=70 if quick else 280)
        sizes = ((300, 300), (317, 451)) if quick else ((300, 300), (1080, 1920))
        out = []
        for h, w in sizes:
            p = processor(images=[synthetic_image(h, w, seed=h + w)], return_tensors="pt")
            out.append((p["pixel_values"], p["image_position_ids"]))
        return out
    extractor = Gemma4AudioFeatureExtractor()
    lengths = (16_000,) if quick else (16_000, 64_000)
    return [tuple(extractor([synthetic_clip(n, seed=n)], return_tensors="pt").values()) for n in lengths]


def soft_tokens(model, tower: str, feed: tuple) -> torch.Tensor:
    with torch.no_grad():
        if tower == "visual":
            return torch.cat(model.model.get_image_features(*feed).pooler_output).float()
        features, mask = feed
        out = model.model.get_audio_features(features, mask, return_dict=True)
        return out.pooler_output[out.attention_mask].float()


def errors(out: torch.Tensor, ref: torch.Tensor) -> dict[str, float]:
    diff = (out - ref).double()
    cos = torch.nn.functional.cosine_similarity(out.double(), ref.double(), dim=-1)
    return {"max_rel": float(diff.abs().max() / ref.abs().max()), "rms_rel": float(diff.norm() / ref.double().norm()),
            "min_cos": float(cos.min())}


def measure(tower: str, init: str, quick: bool, seed: int = 0) -> list[dict]:
    """Errors of the soft tokens vs the tower carrying the checkpoint's weights (rounded to bf16,
    as released checkpoints are), per bit width, and (row ``BF16``) that rounding vs fp32 weights."""
    model = build_model(seed)
    names = tower_linears(model, tower)
    params = dict(model.named_parameters())
    if init == "heavy":
        generator = torch.Generator().manual_seed(seed + 1)
        with torch.no_grad():
            for name in names:
                params[name].copy_(heavy_tailed(tuple(params[name].shape), generator))
    feeds = inputs(tower, quick)
    refs32 = [soft_tokens(model, tower, feed) for feed in feeds]
    checkpoint = {name: stored(params[name].detach(), BF16) for name in names}
    rows = []
    for bits in (BF16, *BITS):
        with torch.no_grad():
            for name in names:
                params[name].copy_(checkpoint[name] if bits == BF16 else stored(checkpoint[name], bits))
        outs = [soft_tokens(model, tower, feed) for feed in feeds]
        if bits == BF16:
            refs = outs
            pairs = zip(outs, refs32)
        else:
            pairs = zip(outs, refs)
        worst: dict[str, float] = {}
        for out, ref in pairs:
            for key, value in errors(out, ref).items():
                worst[key] = min(worst.get(key, 1.0), value) if key == "min_cos" else max(worst.get(key, 0.0), value)
        rows.append({"tower": tower, "init": init, "bits": bits, **worst,
                     "params": sum(checkpoint[n].numel() for n in names)})
    return rows


def runtime_costs(work: Path) -> None:
    """Export E2B-sized towers at each bit width; size, peak RSS and time of each graph in MNN."""
    import subprocess

    from transformers import Gemma4AudioConfig, Gemma4VisionConfig

    from llmexport import ExportOptions, export
    from llmexport.tiny.gemma4 import SHAPES, build_gemma4_checkpoint, text_config_dict

    text = dict(text_config_dict(SHAPES["e2b"]), hidden_size=TEXT_HIDDEN, intermediate_size=64, num_hidden_layers=2,
                layer_types=["sliding_attention", "full_attention"], num_kv_shared_layers=0)
    checkpoint = build_gemma4_checkpoint(work / "checkpoint", text, dtype=torch.bfloat16,
                                         vision_config=Gemma4VisionConfig().to_dict(),
                                         audio_config=Gemma4AudioConfig().to_dict())
    print(f"{'tower':7} {'bits':>4} {'file MB':>8} {'peak RSS MB':>12}")
    for bits in BITS:
        out = work / f"export-{bits}"
        export(checkpoint, out, ExportOptions(quant=QuantScheme(4, BLOCK), visual_quant_bit=bits, audio_quant_bit=bits))
        for tower in ("visual", "audio"):
            proc = subprocess.run([sys.executable, __file__, "--run-module", str(out / f"{tower}.mnn"), tower],
                                  capture_output=True, text=True, check=True)
            size = (out / f"{tower}.mnn.weight").stat().st_size / 1e6
            print(f"{tower:7} {bits:>4} {size:>8.0f} {int(proc.stdout.split()[-1]) / 1024:>12.0f}", flush=True)


def _run_module(model: str, tower: str) -> None:
    """Child of ``runtime_costs``: run the graph once in MNN; print the MNN process's peak RSS (KiB)."""
    import resource

    from llmexport.mnn.runtime import run_module

    if tower == "visual":
        pixels, positions = inputs("visual", False)[0]
        feed = {"input_patches": pixels.numpy(), "image_position_ids": positions.numpy().astype("int32")}
        names = ["image_embeds"]
    else:
        features, mask = inputs("audio", False)[1]  # 4 s
        feed, names = {"input_features": features[:, mask[0]].numpy()}, ["audio_embeds"]
    run_module(Path(model), [feed], names)
    print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--tower", choices=("visual", "audio", "both"), default="both")
    parser.add_argument("--runtime", action="store_true")
    parser.add_argument("--run-module", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.run_module:
        return _run_module(*args.run_module)
    if args.runtime:
        import tempfile

        with tempfile.TemporaryDirectory(prefix="tower-quant-") as tmp:
            return runtime_costs(Path(tmp))
    towers = ("visual", "audio") if args.tower == "both" else (args.tower,)
    print(f"{'tower':7} {'weights':8} {'bits':>4} {'max rel':>9} {'rms rel':>9} {'min cos':>9} {'MB':>7}")
    for tower in towers:
        for init in ("hf-init", "heavy"):
            start = time.perf_counter()
            for row in measure(tower, init, args.quick):
                mb = row["params"] * (2 if row["bits"] in (16, BF16) else row["bits"] / 8) / 1e6
                print(f"{row['tower']:7} {row['init']:8} {row['bits']:>4} {row['max_rel']:>9.2e} "
                      f"{row['rms_rel']:>9.2e} {row['min_cos']:>9.6f} {mb:>7.0f}", flush=True)
            print(f"  ({time.perf_counter() - start:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
