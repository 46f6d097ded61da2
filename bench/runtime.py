"""MNN runtime speed and fidelity of an export under each runtime profile, beside MNN's own exporter.

    python bench/runtime.py [CHECKPOINT] [--out DIR] [--quant_bit 4] [--embed_bit 4] [--threads 2 4]
                            [--reps 3] [--steps 16] [--variant NAME=FLAGS ...]
                            [--mnn-exporter DIR [--mnn-python PY]] [--no-fidelity]

Everything is measured in this one run, side by side, and printed as ratios:
- the checkpoint (default /work/ckpt/e2b-12: E2B dimensions, 12 layers, random weights) is
  exported once per runtime profile (``--runtime_profile fast`` and ``exact``: the same weights,
  only config.json differs) and, with ``--mnn-exporter`` (a checkout's transformers/llm/export
  folder; optional, never a dependency), once by MNN's own exporter, and once per ``--variant``
  (the fast profile plus more flags, e.g. ``lm128="--lm_quant_block 128"``: layout choices);
- speed, per export and thread count, ``--reps`` times interleaved (medians reported), each in a
  fresh process: load time, prefill tokens/s of a 64-token prompt and decode tokens/s of 128 greedy
  steps, as the runtime's own counters report them (``Llm.generate`` + ``get_context``, its generated
  text cleared first: the binding crashes converting non-UTF-8 text). Where the
  ``chrt`` tool may, these children run under SCHED_RR so other processes on a shared machine do
  not distort the numbers;
- fidelity on a fixed chat-templated prompt: each export teacher-forced along the greedy
  continuation of the HF model carrying exactly the weights the export stored (max |dlogit|, mean,
  top-1 agreement), and against the fp32 HF model. Both are streamed references
  (llmexport.reference.streamed: one decoder layer in memory at a time).
  MNN's exporter names its records its own way, and a variant stores other weights, so those are
  compared with fp32 HF only.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PROFILES = ("fast", "exact")
PROMPT_TOKENS, DECODE_STEPS = 64, 128

SPEED_CHILD = r"""
import json, os, sys
import MNN.llm as llm
m = llm.create(sys.argv[1])
m.set_config(json.loads(sys.argv[2]))
m.load()
m._c_obj.generate(list(range(1000, 1000 + int(sys.argv[3]))), int(sys.argv[4]))
# get_context() converts the generated text strictly from UTF-8 and crashes (SIGSEGV) on random
# weights' byte pieces (pymnn/src/llm.h): clear that text first; the counters are what is read
m._c_obj.set_context({"generate_str": ""})
c = m._c_obj.get_context()
print(json.dumps({"load_s": c["load_us"] / 1e6, "prefill_tok_s": c["prompt_len"] / c["prefill_us"] * 1e6,
                  "decode_tok_s": c["gen_seq_len"] / c["decode_us"] * 1e6, "decoded": c["gen_seq_len"]}))
sys.stdout.flush()
os._exit(0)
"""


def realtime_prefix() -> list[str]:
    """``chrt -r 10`` when this process may use it (benchmark children only), else nothing."""
    if shutil.which("chrt") and subprocess.run(["chrt", "-r", "10", "true"], capture_output=True).returncode == 0:
        return ["chrt", "-r", "10"]
    return []


def runtime_speed(export_dir: Path, threads: int, prompt: int = PROMPT_TOKENS, steps: int = DECODE_STEPS,
                  prefix: list[str] | None = None, settings: dict | None = None) -> dict:
    """Load, prefill and decode speed of one export in a fresh process (greedy sampling; ``settings``:
    more runtime config keys)."""
    config = json.dumps({**(settings or {}), "thread_num": threads, "sampler_type": "greedy"})
    cmd = (prefix or []) + [sys.executable, "-c", SPEED_CHILD, str(export_dir / "config.json"), config, str(prompt),
                            str(steps)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    line = next((text for text in proc.stdout.splitlines() if text.startswith("{")), None)
    return json.loads(line) if line else {"error": (proc.stdout + proc.stderr)[-800:]}


def _export(checkpoint: Path, out: Path, args: argparse.Namespace, profile: str, extra: list[str] = ()) -> float:
    cmd = [sys.executable, "-c", "from llmexport.cli import main; main()", "--path", str(checkpoint), "--dst_path",
           str(out), "--quant_bit", str(args.quant_bit), "--quant_block", str(args.quant_block), "--embed_bit",
           str(args.embed_bit), "--runtime_profile", profile, "--quiet", *extra]
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"export ({profile}) failed:\n{proc.stderr[-3000:]}")
    return time.perf_counter() - start


def _mnn_export(checkpoint: Path, out: Path, args: argparse.Namespace, work: Path) -> dict:
    """MNN's own exporter on the same checkpoint; its converter through ``_tools`` (never
    ``MNN.tools.mnnconvert``, which phones home): a wrapper script for its ``--mnnconvert``."""
    from export import _tree_rss

    wrapper = work / "mnnconvert"
    wrapper.write_text(f"#!/bin/sh\nexec {args.mnn_python} -c 'import sys, _tools; _tools.mnnconvert(sys.argv[1:])' "
                       "MNNConvert \"$@\"\n")
    wrapper.chmod(0o755)
    cmd = [args.mnn_python, "llmexport.py", "--path", str(checkpoint), "--export", "mnn", "--dst_path", str(out),
           "--quant_bit", str(args.quant_bit), "--quant_block", str(args.quant_block), "--embed_bit",
           str(args.embed_bit), "--mnnconvert", str(wrapper)]
    start, peak = time.perf_counter(), 0
    with open(work / "mnn-exporter.log", "w") as log:
        proc = subprocess.Popen(cmd, cwd=args.mnn_exporter, stdout=log, stderr=subprocess.STDOUT)
        while proc.poll() is None:
            peak = max(peak, _tree_rss(proc.pid))
            time.sleep(0.1)
    wall = time.perf_counter() - start
    if proc.returncode != 0 or not (out / "config.json").exists():
        tail = (work / "mnn-exporter.log").read_text(errors="replace")[-1500:]
        return {"error": f"exit {proc.returncode}: {tail}"}
    return {"wall_s": wall, "peak_rss_gib": peak / 2**30}


def _speeds(exports: dict[str, Path], threads: list[int], reps: int) -> dict:
    prefix = realtime_prefix()
    runs: dict[str, dict[int, list[dict]]] = {name: {t: [] for t in threads} for name in exports}
    for _ in range(reps):  # interleaved, so a busy moment hits every export alike
        for name, path in exports.items():
            for t in threads:
                runs[name][t].append(runtime_speed(path, t, prefix=prefix))
    out = {}
    for name, by_threads in runs.items():
        for t, results in by_threads.items():
            good = [r for r in results if "error" not in r]
            out[f"{name}@{t}"] = ({k: statistics.median(r[k] for r in good) for k in good[0]} if good
                                  else {"error": results[0]["error"]})
    return {"realtime": bool(prefix), "median_of": reps, "runs": out}


def _fidelity(checkpoint: Path, exports: dict[str, Path], work: Path, steps: int) -> dict:
    """Teacher-forced logits of each export against the stored-weights and the fp32 HF models."""
    import torch
    from transformers import AutoTokenizer

    from llmexport.mnn.readback import StoredTensors
    from llmexport.mnn.runtime import run_runtime
    from llmexport.reference.streamed import streamed_reference
    from llmexport.source.checkpoint import Checkpoint, CheckpointTensors
    from llmexport.source.loading import open_architecture
    from llmexport.verification.logits import compare_logits
    from llmexport.verification.media import reference_greedy
    from llmexport.verification.verify import default_prompt

    arch = open_architecture(Checkpoint.open(checkpoint))
    prompt = default_prompt(AutoTokenizer.from_pretrained(checkpoint), PROMPT_TOKENS)
    references, memory = {}, {}
    fp32 = CheckpointTensors(arch.checkpoint.weights)
    for label, tensors in (("stored", StoredTensors(exports["fast"], arch, fp32, arch.towers())), ("fp32", fp32)):
        model = streamed_reference(arch, tensors)
        if label == "stored":
            greedy, _ = reference_greedy(lambda ids, m=model: arch.reference_logits(m, torch.tensor(ids)), prompt,
                                         steps, ())
        forced = prompt + greedy[:-1]
        references[label] = arch.reference_logits(model, torch.tensor(forced))[len(prompt) - 1:].numpy()
        memory[label] = _rss()
        del model
    out = {"prompt_tokens": len(prompt), "steps": steps, "reference_rss_gib": memory}
    for name, path in exports.items():
        run = run_runtime(path, prompt, greedy[:-1], steps, config={"thread_num": 2})
        versus = ("stored", "fp32") if name in PROFILES else ("fp32",)
        out[name] = {label: compare_logits(run.forced_logits, references[label]).summary().to_json()
                     for label in versus}
        out[name]["greedy_match"] = run.greedy_ids == greedy
    return out


def _rss() -> dict[str, float]:
    """This process's resident memory (GiB): anonymous, and file-backed (the mapped reference)."""
    fields = dict(line.split(":", 1) for line in open("/proc/self/status") if line.startswith(("RssAnon", "RssFile")))
    return {k: round(int(v.split()[0]) / 2**20, 2) for k, v in fields.items()}



def _report(result: dict) -> None:
    speed = result["speed"]["runs"]
    print(f"speed (medians of {result['speed']['median_of']}, realtime scheduling: {result['speed']['realtime']}):")
    for key, r in speed.items():
        if "error" in r:
            print(f"  {key:22s} ERROR {r['error'][-200:]}")
            continue
        print(f"  {key:22s} load {r['load_s']:6.2f} s  prefill {r['prefill_tok_s']:7.1f} tok/s  "
              f"decode {r['decode_tok_s']:6.2f} tok/s")
    for key in speed:
        name, t = key.split("@")
        # the fast profile against the exact one and MNN's exporter; every other export against fast
        for base_name in (("exact", "mnn-exporter") if name == "fast" else ("fast",) if name != "exact" else ()):
            base, mine = speed.get(f"{base_name}@{t}"), speed[key]
            if base and "error" not in base and "error" not in mine:
                print(f"  {key} / {base_name}@{t}: " + ", ".join(
                    f"{k} x{mine[k] / base[k]:.2f}" for k in ("load_s", "prefill_tok_s", "decode_tok_s")))
    for name, fid in result.get("fidelity", {}).items():
        if isinstance(fid, dict) and "greedy_match" in fid:
            print(f"fidelity {name}: " + "; ".join(
                f"vs {label} HF: max |dlogit| {s['max_abs_err']:.4f}, mean {s['mean_abs_err']:.5f}, "
                f"top-1 {s['top1_agreement']:.0%}" for label, s in fid.items() if isinstance(s, dict))
                + f"; greedy {'match' if fid['greedy_match'] else 'differs'}")


def main() -> None:
    from llmexport.planning.digests import file_sha256

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", type=Path, nargs="?", default=Path("/work/ckpt/e2b-12"))
    parser.add_argument("--out", type=Path, default=None, help="keep the exports and runtime.json here")
    parser.add_argument("--quant_bit", type=int, default=4)
    parser.add_argument("--quant_block", type=int, default=64)
    parser.add_argument("--embed_bit", type=int, default=4)
    parser.add_argument("--threads", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--steps", type=int, default=16, help="fidelity: greedy steps after the prompt")
    parser.add_argument("--variant", action="append", default=[], metavar="NAME=FLAGS",
                        help="also export with the fast profile and these extra llmexport flags")
    parser.add_argument("--mnn-exporter", type=Path, default=None,
                        help="folder of MNN's transformers/llm/export (llmexport.py) to compare with")
    parser.add_argument("--mnn-python", default=sys.executable, help="interpreter that runs MNN's exporter")
    parser.add_argument("--no-fidelity", action="store_true")
    args = parser.parse_args()
    work = args.out or Path(tempfile.mkdtemp(prefix="llmexport-runtime-"))
    work.mkdir(parents=True, exist_ok=True)
    exports = {profile: work / f"export-{profile}" for profile in PROFILES}
    result: dict = {"checkpoint": str(args.checkpoint), "export_wall_s": {}}
    for profile, path in exports.items():
        result["export_wall_s"][profile] = _export(args.checkpoint, path, args, profile)
    assert file_sha256(exports["fast"] / "llm.mnn.weight") == file_sha256(exports["exact"] / "llm.mnn.weight")
    for variant in args.variant:
        name, _, flags = variant.partition("=")
        exports[name] = work / f"export-{name}"
        result["export_wall_s"][name] = _export(args.checkpoint, exports[name], args, "fast", flags.split())
    if args.mnn_exporter:
        result["mnn_exporter"] = _mnn_export(args.checkpoint, work / "export-mnn-exporter", args, work)
        if "error" not in result["mnn_exporter"]:
            exports["mnn-exporter"] = work / "export-mnn-exporter"
    result["speed"] = _speeds(exports, args.threads, args.reps)
    if not args.no_fidelity:
        result["fidelity"] = _fidelity(args.checkpoint, exports, work, args.steps)
    import resource

    # this process (the HF references of the fidelity step), file-backed mapped pages included
    result["bench_peak_rss_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    (work / "runtime.json").write_text(json.dumps(result, indent=2))
    print(f"checkpoint {args.checkpoint}; exports in {work}; export wall (s): "
          + json.dumps({k: round(v, 1) for k, v in result["export_wall_s"].items()}))
    if "mnn_exporter" in result:
        print("MNN's exporter: " + json.dumps(result["mnn_exporter"])[:600])
    _report(result)
    print(f"peak RSS of this process (fidelity references, mapped file pages included): "
          f"{result['bench_peak_rss_gib']:.2f} GiB; after each reference: "
          + json.dumps(result.get("fidelity", {}).get("reference_rss_gib")))


if __name__ == "__main__":
    main()
