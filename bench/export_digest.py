"""The sha256 of every file of a spread of exports: proof that a refactor leaves the bytes alone.

    python bench/export_digest.py OUT.json                 # build, export, record the digests
    python bench/export_digest.py OUT.json --compare BASE.json   # ... and list every difference

Tiny checkpoints of every registered family and variant (Gemma4 in its four shapes and with its
vision and audio towers, K2-Horizon, the Llama/Qwen3/Qwen3-MoE variants, LFM2, Qwen3.5, MLX-quantized Gemma4 and
K2-Horizon) are built from fixed seeds and exported with a spread of options (bits, blocks, sym, HQQ, recipes, a
quant_config file, lm_head and tower schemes, table widths, runtime profile, chat thinking, ONNX).
Each case records every file's sha256 (manifest.json too: it lists the options and the plan's
prequantized summary). ``--compare`` exits 1 when any case, file or digest differs.
Run it at two commits with the same environment; it needs no network and a few minutes.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from llmexport.planning.digests import file_sha256  # noqa: E402

QUANT_CONFIG = {"default": {"bits": 4, "block": 32},
                "rules": [{"match": "role:attention", "bits": 8, "block": 64, "sym": True},
                          {"match": "*.down_proj", "bits": 8, "block": 0, "method": "hqq"},
                          {"match": "role:lm_head", "bits": 8, "block": 128}],
                "embed_bit": 4}

GEMMA4_E2B = [
    [],
    ["--quant_bit", "8", "--embed_bit", "4", "--hqq", "--visual_quant_bit", "4", "--audio_quant_bit", "8"],
    ["--quant_config", "mlp4-attn8", "--sym"],
    ["--quant_bit", "16"],
    ["--quant_config", "@quant_config"],
    ["--lm_quant_bit", "8", "--quant_block", "32", "--embed_bit", "8", "--runtime_profile", "exact",
     "--chat_thinking", "on", "--thread_num", "2"],
    ["--quant_bit", "2", "--quant_block", "0", "--visual_quant_bit", "8", "--audio_quant_bit", "4"],
    ["--export", "onnx"],
]
TOWERS = [[], ["--visual_quant_bit", "4", "--audio_quant_bit", "8", "--embed_bit", "4", "--hqq"],
          ["--visual_quant_bit", "8", "--audio_quant_bit", "4", "--quant_block", "32", "--sym", "--embed_bit", "8"]]
OTHER = [[], ["--quant_bit", "8", "--quant_block", "0", "--embed_bit", "8", "--sym"],
         ["--quant_config", "@quant_config", "--hqq"]]


def _checkpoints(root: Path) -> dict[str, tuple[Path, list[list[str]]]]:
    from llmexport.tiny.decoders import VARIANTS as DECODERS
    from llmexport.tiny.decoders import build_tiny_decoder
    from llmexport.tiny.gemma4 import SHAPES, build_tiny_gemma4
    from llmexport.tiny.gemma4_towers import MULTIMODAL, build_tiny_multimodal
    from llmexport.tiny.k2_horizon import VARIANTS as K2
    from llmexport.tiny.k2_horizon import build_tiny_k2_horizon
    from llmexport.tiny.lfm2 import VARIANTS as LFM2
    from llmexport.tiny.lfm2 import build_tiny_lfm2
    from llmexport.tiny.qwen3_5 import VARIANTS as QWEN3_5
    from llmexport.tiny.qwen3_5 import build_tiny_qwen3_5

    cases: dict[str, tuple[Path, list[list[str]]]] = {}
    for shape in SHAPES:
        path = build_tiny_gemma4(root / f"gemma4-{shape}", shape, seed=1)
        cases[f"gemma4-{shape}"] = (path, GEMMA4_E2B if shape == "e2b" else OTHER)
    cases["gemma4-e2b-text"] = (build_tiny_gemma4(root / "gemma4-e2b-text", "e2b", seed=2, text_only=True), OTHER)
    for name in MULTIMODAL:
        cases[f"gemma4-{name}"] = (build_tiny_multimodal(root / f"gemma4-{name}", name, seed=1), TOWERS)
    for variant in K2:
        cases[f"k2-{variant}"] = (build_tiny_k2_horizon(root / f"k2-{variant}", variant, seed=1), OTHER)
    for variant in DECODERS:
        cases[f"decoder-{variant}"] = (build_tiny_decoder(root / f"decoder-{variant}", variant, seed=1), OTHER)
    for variant in LFM2:
        cases[f"lfm2-{variant}"] = (build_tiny_lfm2(root / f"lfm2-{variant}", variant, seed=1), OTHER)
    for variant in QWEN3_5:
        cases[f"qwen3_5-{variant}"] = (build_tiny_qwen3_5(root / f"qwen3_5-{variant}", variant, seed=1), OTHER)
    cases.update(_mlx_checkpoints(root))
    return cases


def _mlx_checkpoints(root: Path) -> dict[str, tuple[Path, list[list[str]]]]:
    """MLX-quantized checkpoints as the MLX import tests build them (mlx-lm's convert)."""
    try:
        mlx_convert = importlib.import_module("mlx_lm.convert")  # the package re-exports a function as .convert
        from test_mlx_import import _gemma4_hf, _k2_mlx
    except ImportError as exc:  # mlx is a test extra; say so rather than silently shrink the spread
        print(f"no MLX cases: {exc}", file=sys.stderr)
        return {}
    from llmexport.tiny.k2_horizon import build_tiny_k2_horizon

    as_stored = [[], ["--requantize", "--quant_bit", "8"], ["--embed_bit", "8", "--lm_quant_bit", "8"]]
    cases = {}
    recipes = (("e2b", {"q_bits": 4}), ("26b-a4b", {"q_bits": 4}), ("e2b", {"quant_predicate": "mixed_3_6"}))
    for shape, kwargs in recipes:
        name = f"mlx-{shape}-{kwargs.get('q_bits', kwargs.get('quant_predicate'))}"
        hf = _gemma4_hf(root / f"{name}-hf", shape)
        mlx_convert.convert(str(hf), str(root / name), quantize=True, q_group_size=64, **kwargs)
        cases[name] = (root / name, as_stored)
    hf = build_tiny_k2_horizon(root / "mlx-k2-hf", "sparse")
    cases["mlx-k2-sparse"] = (_k2_mlx(hf, root / "mlx-k2-sparse"), as_stored)
    return cases


def _export(path: Path, flags: list[str], dst: Path, quant_config: Path) -> dict[str, str]:
    flags = [str(quant_config) if f == "@quant_config" else f for f in flags]
    cmd = [sys.executable, "-c", "from llmexport.cli import main; main()",
           "--path", str(path), "--dst_path", str(dst), "--quiet", *flags]
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    if proc.returncode != 0:
        return {"<exit>": f"{proc.returncode}: {proc.stderr.strip().splitlines()[-1:]}"}
    return {p.name: file_sha256(p) for p in sorted(dst.iterdir()) if p.is_file()}


def digests(root: Path) -> dict[str, dict[str, str]]:
    quant_config = root / "quant_config.json"
    quant_config.write_text(json.dumps(QUANT_CONFIG))
    out: dict[str, dict[str, str]] = {}
    for name, (path, matrix) in _checkpoints(root / "ckpt").items():
        for i, flags in enumerate(matrix):
            key = f"{name} {' '.join(flags) or '(defaults)'}"
            out[key] = _export(path, flags, root / "out" / f"{name}-{i}", quant_config)
            print(f"{key}: {len(out[key])} files", flush=True)
    return out


def compare(now: dict[str, dict[str, str]], base: dict[str, dict[str, str]]) -> list[str]:
    diffs = [f"case only in {where}: {case}" for where, a, b in (("base", base, now), ("this run", now, base))
             for case in sorted(set(a) - set(b))]
    for case in sorted(set(now) & set(base)):
        for file in sorted(set(now[case]) | set(base[case])):
            if now[case].get(file) != base[case].get(file):
                diffs.append(f"{case}: {file}: {base[case].get(file, 'absent')} -> {now[case].get(file, 'absent')}")
    return diffs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--compare", type=Path, default=None)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="llmexport-digest-") as tmp:
        result = digests(Path(tmp))
    args.out.write_text(json.dumps(result, indent=1, sort_keys=True))
    failed = [case for case, files in result.items() if "<exit>" in files]
    print(f"{len(result)} exports, {sum(len(f) for f in result.values())} files, {len(failed)} failed: {failed}")
    if args.compare:
        diffs = compare(result, json.loads(args.compare.read_text()))
        print("\n".join(diffs) if diffs else "identical to the base: every case, file and digest")
        sys.exit(1 if diffs else 0)


if __name__ == "__main__":
    main()
